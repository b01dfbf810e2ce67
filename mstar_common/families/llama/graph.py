"""Llama text LMs (LlamaForCausalLM): one autoregressive component, the same walk as Qwen3.

    client ──text/messages──▶ llm  (tokenize → prefill → decode loop inside the component → detokenize)
                                 └──text deltas + token ids (streamed, coalesced when behind)──▶ client
"""

from mstar_common.families.qwen3.graph import GRAPH  # noqa: F401 - the text-LM graph is family-independent
