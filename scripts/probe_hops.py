#!/usr/bin/env python
"""What a BLS hop costs by the bytes it carries: the image walk's two big hops, alone, in a real tritonserver.

    python scripts/probe_hops.py [--shm-mb 128] [--requests 12]

Three throwaway Python models in a temporary repository: `te` answers a [512, 7680] prompt embedding (fp32, or
bf16 bits as UINT16: the same bytes as TYPE_BF16), `dn` takes it and answers a 1024x1024x3 uint8 image, and a
decoupled `walk` calls `te` then `dn` with async BLS and reports each hop's wall time. Per mode: the embedding
copied into a new tensor for the `dn` hop (as the walk router did) or forwarded as the tensor received (as it
does now), and `none` (`dn` sent one value: the image's return alone). Prints the p50 of each hop in ms.
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_common.launcher import bare_triton  # noqa: E402

MODES = ("fp32", "bf16", "fp32 forwarded", "bf16 forwarded", "none")

CONFIG = '''name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {inputs} ]
output [ {outputs} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
'''
EMB = '{ name: "EMB", data_type: TYPE_FP32, dims: [ -1, -1 ]%s }'
EMB16 = '{ name: "EMB16", data_type: TYPE_UINT16, dims: [ -1, -1 ]%s }'
OPTIONAL = ", optional: true"
MODE = '{ name: "MODE", data_type: TYPE_INT32, dims: [ 1 ] }'

TE = '''import numpy as np, triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def initialize(self, args):
        self.e32 = np.random.default_rng(0).standard_normal((512, 7680), dtype=np.float32)
        self.e16 = (self.e32.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits
    def execute(self, requests):
        for r in requests:
            fp32 = int(pb_utils.get_input_tensor_by_name(r, "MODE").as_numpy()[0]) in (0, 2)
            t = pb_utils.Tensor("EMB", self.e32.copy()) if fp32 else pb_utils.Tensor("EMB16", self.e16.copy())
            r.get_response_sender().send(pb_utils.InferenceResponse([t]),
                                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''
DN = '''import numpy as np, triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def initialize(self, args):
        self.pixels = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    def execute(self, requests):
        for r in requests:
            for name in ("EMB", "EMB16"):
                t = pb_utils.get_input_tensor_by_name(r, name)
                if t is not None:
                    t.as_numpy()
            r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("PIX", self.pixels.copy())]),
                                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''
WALK = '''import time, numpy as np, triton_python_backend_utils as pb_utils
HELD = []
class TritonPythonModel:
    async def call(self, model, inputs, outputs, keep_tensor):
        memory = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)
        request = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs,
                                            preferred_memory=memory)
        responses = await request.async_exec(decoupled=True)
        got = {}
        for response in responses:
            for name in outputs:
                t = pb_utils.get_output_tensor_by_name(response, name)
                if t is not None:
                    got[name] = t if keep_tensor else np.array(t.as_numpy())
        HELD.append(responses)  # the stub must not free a finished iterator off the GIL (backends/bls.py)
        del HELD[:-16]
        return got
    async def execute(self, requests):
        for r in requests:
            mode = pb_utils.get_input_tensor_by_name(r, "MODE").as_numpy()
            forwarded = int(mode[0]) in (2, 3)
            name = "EMB" if int(mode[0]) in (0, 2) else "EMB16"
            t0 = time.perf_counter()
            emb = await self.call("te", [pb_utils.Tensor("MODE", mode)], [name], forwarded)
            t1 = time.perf_counter()
            if int(mode[0]) == 4:
                sent = pb_utils.Tensor("EMB16", np.zeros((1, 1), np.uint16))
            elif forwarded:
                sent = emb[name]
            else:
                sent = pb_utils.Tensor(name, np.ascontiguousarray(emb[name]))
            await self.call("dn", [sent], ["PIX"], False)
            ms = np.array([(t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3], np.float32)
            r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("MS", ms)]),
                                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def write_repository(root: Path) -> Path:
    models = {
        "te": (TE, MODE, f"{EMB % ''}, {EMB16 % ''}"),
        "dn": (DN, f"{EMB % OPTIONAL}, {EMB16 % OPTIONAL}",
               '{ name: "PIX", data_type: TYPE_UINT8, dims: [ -1, -1, -1 ] }'),
        "walk": (WALK, MODE, '{ name: "MS", data_type: TYPE_FP32, dims: [ 2 ] }'),
    }
    repo = root / "repo"
    for name, (code, inputs, outputs) in models.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, inputs=inputs, outputs=outputs))
        (repo / name / "1" / "model.py").write_text(code)
    return repo


def measure(url: str, requests: int) -> dict[str, tuple[float, float]]:
    import tritonclient.grpc as grpcclient

    from mstar_common.bench.drivers import triton_grpc_client

    client = triton_grpc_client(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    report = {}
    try:
        for mode, label in enumerate(MODES):
            times = []
            for _ in range(requests + 2):  # the first two warm up
                value = grpcclient.InferInput("MODE", [1], "INT32")
                value.set_data_from_numpy(np.array([mode], np.int32))
                client.async_stream_infer("walk", [value])
                result, error = results.get(timeout=120)
                if error is not None:
                    raise RuntimeError(f"{label}: {error}")
                times.append(result.as_numpy("MS"))
            text_hop, image_hop = np.median(np.array(times[2:]), axis=0)
            report[label] = (round(float(text_hop), 1), round(float(image_hop), 1))
            print(f"{label:>15}: embedding hop p50 {text_hop:.1f} ms, image hop p50 {image_hop:.1f} ms", flush=True)
    finally:
        client.stop_stream()
        client.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shm-mb", type=int, default=128, help="the Python backend's shared memory per stub")
    parser.add_argument("--requests", type=int, default=12, help="timed requests per mode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="probe-hops-") as tmp:
        repo = write_repository(Path(tmp))
        shm = f"--backend-config=python,shm-default-byte-size={args.shm_mb << 20}"
        with bare_triton(repo, Path(tmp) / "tritonserver.log", (shm,)) as url:
            measure(url, args.requests)


if __name__ == "__main__":
    main()
