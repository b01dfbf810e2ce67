"""Qwen3 dense text LMs (Qwen3ForCausalLM, 0.6B-32B): one autoregressive component.

    client ──text/messages──▶ llm  (tokenize → prefill → decode loop inside the component → detokenize)
                                 └──text deltas + token ids (streamed, coalesced when behind)──▶ client

The decode loop never leaves the component, so the walk is a Loop over one component that is also the
entry model (`qwen3_llm`): no BLS hop on the token path.
"""

from mstar_common.families.text import TEXT_LM_INPUTS, TEXT_LM_OUTPUTS
from mstar_common.graph import Component, FamilyGraph, Loop, Step, Walk

LLM = Component("llm", "autoregressive", TEXT_LM_INPUTS, TEXT_LM_OUTPUTS, streams=True, holds_kv=True)

GRAPH = FamilyGraph(
    components={"llm": LLM},
    walks={
        "generate": Walk(
            "generate",
            Loop(Step("llm"), until="eos | stop string | stop token | max_tokens"),
            entry="llm",
            description="chat and completion: prefill then decode, streamed",
        ),
    },
)
