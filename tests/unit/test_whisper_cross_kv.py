"""Whisper's decoder holds one cross-attention K/V slot per admitted request (families/whisper/modeling.py): taken
by the engine's `admit_request` hook, given back by `release_request`. A slot must come back on every path, or
the component admits fewer requests for the rest of its life."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    from mstar_common.families.whisper.loader import load_decoder
    from mstar_common.families.whisper.tiny import build_tiny_checkpoint

    model = load_decoder(build_tiny_checkpoint(tmp_path_factory.mktemp("whisper") / "tiny"))
    model.configure_slots(2, 16)
    return model


def _state(model) -> SimpleNamespace:
    source = torch.randn(model.config.max_source_positions, model.config.d_model)
    return SimpleNamespace(take_encoder_output=lambda: source)


def test_a_slot_is_taken_at_admission_and_given_back_at_release(decoder):
    slot = decoder.admit_request(_state(decoder))
    assert decoder.cross_kv.num_free_slots == 1
    decoder.release_request(slot)
    assert decoder.cross_kv.num_free_slots == 2


def test_an_admission_that_fails_while_it_writes_the_slot_gives_the_slot_back(decoder, monkeypatch):
    """The engine refuses the request (scheduler.refused) and never learns of a slot that `admit_request` took
    before it raised, so the hook must give it back itself."""
    layer = decoder.model.decoder.layers[-1].encoder_attn

    def out_of_memory(source):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(layer, "project_source", out_of_memory)
    for _ in range(3):
        with pytest.raises(torch.OutOfMemoryError):
            decoder.admit_request(_state(decoder))
    assert decoder.cross_kv.num_free_slots == 2
    monkeypatch.undo()
    slots = [decoder.admit_request(_state(decoder)) for _ in range(2)]
    assert sorted(slots) == [0, 1] and not decoder.can_admit_request()
    for slot in slots:
        decoder.release_request(slot)


def test_the_slots_held_are_the_components_state_slots_gauge(decoder):
    """`mstar_state_slots_used` read 0 on Whisper's decoder whatever it held (the engine reported no count), so the
    fuzz and soak scripts' "nothing held" check could not see a slot that never came back."""
    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.types import EngineConfig

    engine = AREngine(decoder, EngineConfig(num_kv_pages=16, page_size=16, max_num_seqs=2, max_batch_tokens=64,
                                            device="cpu"), eos_token_ids=[0], vocab_size=decoder.config.vocab_size)
    try:
        assert engine.stats()["num_used_state_slots"] == 0
        slot = decoder.admit_request(_state(decoder))
        assert engine.stats()["num_used_state_slots"] == 1
        decoder.release_request(slot)
        assert engine.stats()["num_used_state_slots"] == 0
    finally:
        engine.shutdown()
