"""perf_analyzer input-data files for the speech, transcription and image walks (the text LM's are workload.py's).

Each writes what that family's own benchmark script sends (scripts/bench_orpheus.py, bench_whisper.py,
bench_flux2.py), one request an entry, as perf_analyzer reads it: a TYPE_STRING input of dims [1] as a list of one
string, or, where the bytes are not text (an audio upload), `{"b64": ...}` of the tensor's serialized form (each
element a 4-byte little-endian length, then its bytes). `check_against_config` holds a file to the entry model's
config as perf_analyzer would, and `infer_inputs` turns an entry into the tensors perf_analyzer sends, so a test
can replay a file against a running server.
"""

from __future__ import annotations

import base64
import io
import math
import struct

import numpy as np

from mstar_common import wire

# the first is what scripts/bench_orpheus.py speaks; three more of about its length (a text and seed a request)
SPEECH_TEXTS = (
    "Hey there, my name is Tara, and I'm a speech generation model that can sound like a person.",
    "The weather today is mild, with a light breeze from the west and clear skies expected by evening.",
    "Please remember to bring your notes to the meeting, since we will go through the plan step by step.",
    "A good story needs a beginning that pulls you in, a middle that surprises you, and an ending that lands.",
)
IMAGE_PROMPTS = (  # the first is scripts/bench_flux2.py's (it takes it from here)
    "a photograph of a red fox standing in fresh snow, golden hour",
    "a watercolor painting of a lighthouse on a rocky coast at dawn",
    "a close-up photograph of dew drops on a green leaf, shallow depth of field",
    "an isometric illustration of a small city block with trees and bicycles",
)
WHISPER_RATE = 16_000



def speech_data(max_tokens: int = 1200, num: int = 4, voice: str = "tara") -> dict:
    """Orpheus (`orpheus_lm`): a text each, the voice, exactly `max_tokens` audio tokens (ignore_eos), a seed each;
    the sampling knobs are the deployment's (the reference's)."""
    return {"data": [{wire.TEXT_INPUT: [SPEECH_TEXTS[i % len(SPEECH_TEXTS)]], wire.VOICE: [voice],
                      "max_tokens": [max_tokens], "ignore_eos": [True], "seed": [i]} for i in range(num)]}


def whisper_clip(index: int, seconds: float) -> np.ndarray:
    """The Whisper benchmark's clip (scripts/bench_whisper.py takes it from here): a gliding tone under an envelope
    and a little noise, 16 kHz float32."""
    t = np.arange(int(WHISPER_RATE * seconds)) / WHISPER_RATE
    wave = np.sin(2 * np.pi * (150 + 37 * index) * t * (1 + 0.3 * np.sin(2 * np.pi * 0.5 * t)))
    noise = 0.02 * np.random.default_rng(index).standard_normal(t.shape[0])
    return (0.3 * wave * (0.5 + 0.5 * np.sin(2 * np.pi * (1 + index % 5) * t)) + noise).astype(np.float32)


def whisper_data(seconds: float = 30.0, max_tokens: int = 128, num: int = 4, language: str = "en") -> dict:
    """Whisper (`whisper_walk`): an Ogg/Opus upload each (what libsndfile writes and reads: 30 s is ~107 KB, where
    WAV is 960 KB and FLAC ~730 KB), the language given (no detection pass), `max_tokens` text tokens a window."""
    import soundfile

    data = []
    for i in range(num):
        out = io.BytesIO()
        soundfile.write(out, whisper_clip(i, seconds), WHISPER_RATE, format="OGG", subtype="OPUS")
        data.append({"audio": {"b64": serialized_bytes([out.getvalue()])}, "language": [language],
                     "max_tokens": [max_tokens]})
    return {"data": data}


def image_data(num: int = 4) -> dict:
    """The image walks (`flux2_klein_walk`, `z_image_turbo_walk`): a prompt and a seed each; the size and the
    steps are the deployment's defaults (`default_size`, the model's steps), as the benchmarks serve them."""
    return {"data": [{"prompt": [IMAGE_PROMPTS[i % len(IMAGE_PROMPTS)]], "seed": [i]} for i in range(num)]}


def family_file(family: str, num: int, max_tokens: int | None = None, seconds: float = 30.0) -> tuple[str, dict]:
    """(file name, data) of `mstar bench perf-analyzer-data --family FAMILY` (FAMILY: orpheus, whisper, image)."""
    if family == "orpheus":
        tokens = 1200 if max_tokens is None else max_tokens
        return f"speech_{tokens}tok", speech_data(tokens, num)
    if family == "whisper":
        tokens = 128 if max_tokens is None else max_tokens
        return f"clips_{seconds:g}s_opus_{tokens}tok", whisper_data(seconds, tokens, num)
    if family == "image":
        return "prompts", image_data(num)
    raise ValueError(f"family: one of orpheus, whisper, image, got {family!r}")


ENTRY_MODELS = {"orpheus": ("orpheus_lm",), "whisper": ("whisper_walk",),
                "image": ("flux2_klein_walk", "z_image_turbo_walk")}


def serialized_bytes(elements: list[bytes]) -> str:
    """A BYTES tensor's elements in Triton's serialized form (tritonclient's: each a 4-byte little-endian length,
    then its bytes), base64: what perf_analyzer's `{"b64": ...}` holds for a STRING input."""
    from tritonclient.utils import serialize_byte_tensor

    return base64.b64encode(serialize_byte_tensor(np.array(elements, dtype=np.object_)).item()).decode()


def deserialized_bytes(text: str) -> list[bytes]:
    """`serialized_bytes` undone; ValueError where the lengths do not add up to the bytes."""
    from tritonclient.utils import deserialize_bytes_tensor

    try:
        return list(deserialize_bytes_tensor(base64.b64decode(text, validate=True)))
    except struct.error:
        raise ValueError("serialized BYTES data cut short of the lengths it declares") from None


def check_against_config(data: dict, config: dict) -> None:
    """ValueError naming the entry and the input where an input-data file does not fit the entry model's config
    (`config`: tritonclient's `get_model_config(as_json=True)["config"]`, or the same fields from config.pbtxt):
    a name it lacks, a JSON value of the wrong type, a fixed-size input given the wrong number of elements."""
    inputs = {spec["name"]: spec for spec in config["input"]}
    for index, entry in enumerate(data["data"]):
        for name, value in entry.items():
            where = f"data[{index}].{name}"
            if name not in inputs:
                raise ValueError(f"{where}: not an input of {config.get('name')} (its inputs: {sorted(inputs)})")
            spec = inputs[name]
            values = _values(value, spec["data_type"], where)
            dims = [int(d) for d in spec["dims"]]
            shape = _shape(value, dims, where)
            if len(values) != int(np.prod(shape)):
                raise ValueError(f"{where}: {len(values)} elements for shape {shape}")
            dtype = spec["data_type"].removeprefix("TYPE_")
            if rule := next((r for v in values if (r := json_type_rule(dtype, v))), None):
                raise ValueError(f"{where}: {spec['data_type']}: {rule}")
            if (bounds := _INT_RANGES.get(spec["data_type"])) and not all(bounds[0] <= v <= bounds[1] for v in values):
                raise ValueError(f"{where}: a value outside {spec['data_type']}'s range")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type_rule(dtype: str, value) -> str | None:
    """The JSON type perf_analyzer needs for a value of Triton type `dtype` (BOOL, INT32, FP32, STRING, ...: a BOOL
    is a JSON bool, an integer an integer, a float any number, a STRING a string), where `value` is not of it; None
    where it is."""
    if dtype == "BOOL":
        return None if isinstance(value, bool) else "must be true or false"
    if dtype.startswith(("INT", "UINT")):
        return None if is_int(value) else "must be an integer"
    if dtype in ("STRING", "BYTES"):
        return None if isinstance(value, str) else "must be a string"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "must be a number"
    # NaN and Infinity, which Python's json reads, are not JSON (perf_analyzer's reader refuses them)
    return None if math.isfinite(value) else "must be a finite number"


_INT_RANGES = {"TYPE_INT32": (-2**31, 2**31 - 1), "TYPE_INT64": (-2**63, 2**63 - 1)}


def _shape(value, dims: list[int], where: str) -> list[int]:
    """The shape an entry's input is sent at: its `"shape"` where it gives one (of the config's rank, equal to it
    on every fixed dim), else the config's dims, which must then be fixed (perf_analyzer refuses a variable dim
    with no shape unless --shape names one, and no flags.txt here does)."""
    given = value.get("shape") if isinstance(value, dict) else None
    if given is None:
        if -1 in dims:
            raise ValueError(f"{where}: dims {dims} are variable: the entry must give a \"shape\"")
        return dims
    if not isinstance(given, list) or len(given) != len(dims) or not all(
            isinstance(g, int) and not isinstance(g, bool) and g >= 0 and d in (-1, g)
            for g, d in zip(given, dims, strict=True)):
        raise ValueError(f"{where}: shape {given} does not fit dims {dims}")
    return given


def _values(value, data_type: str, where: str) -> list:
    content = value["content"] if isinstance(value, dict) and "content" in value else value
    if isinstance(content, dict):
        if data_type != "TYPE_STRING" or set(content) != {"b64"}:
            raise ValueError(f"{where}: only a STRING input is given as b64 here")
        return [e.decode("latin-1") for e in deserialized_bytes(content["b64"])]
    if not isinstance(content, list):
        raise ValueError(f"{where}: a list of values, {{'content': ...}} or {{'b64': ...}}")
    return content


def infer_inputs(entry: dict, config: dict) -> dict[str, tuple[np.ndarray, str]]:
    """One entry as the tensors perf_analyzer sends: name -> (array, Triton datatype)."""
    types = {spec["name"]: spec["data_type"] for spec in config["input"]}
    out = {}
    for name, value in entry.items():
        data_type = types[name]
        content = value["content"] if isinstance(value, dict) and "content" in value else value
        if data_type == "TYPE_STRING":
            elements = deserialized_bytes(content["b64"]) if isinstance(content, dict) else \
                [str(s).encode() for s in content]
            out[name] = (np.array(elements, dtype=np.object_), "BYTES")
        else:
            dtype = {"TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
                     "TYPE_FP32": np.float32}[data_type]
            out[name] = (np.array(content, dtype=dtype), data_type.removeprefix("TYPE_"))
        if isinstance(value, dict) and "shape" in value:
            out[name] = (out[name][0].reshape(value["shape"]), out[name][1])
    return out
