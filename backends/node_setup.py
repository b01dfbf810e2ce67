"""What every component node reads in `initialize`: its config parameters, deployment, family and device."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import triton_python_backend_utils as pb_utils

from mstar_common.checkpoints import resolve_checkpoint
from mstar_common.config import Deployment, deployment_from_dict
from mstar_common.devices import use_device
from mstar_common.families.base import Family
from mstar_common.families.registry import get_family
from mstar_common.gil import apply_switch_interval
from mstar_common.graph import Component
from mstar_common.native_backtrace import load_from_env as load_native_backtrace
from mstar_common.orphan_watch import kill_when_orphaned
from mstar_common.process_log import configure_logging
from mstar_common.stall_watch import stack_dump_s
from mstar_common.switches import check_switches

logger = logging.getLogger(__name__)

END_STUB_GRACE_S = 1.0  # a stub whose engine process died waits this long for its error responses to go out


@dataclass(slots=True)
class NodeSetup:
    model_name: str
    deployment: Deployment
    family: Family
    component: Component
    checkpoint: Path
    device: str
    instance: str = ""  # Triton's instance name (model_instance_name)

    def build(self):
        """The family's runtime for this component on this instance's device."""
        return self.family.build_component(self.component.name, self.deployment, self.checkpoint, self.device)

    def build_runtime(self):
        """An autoregressive component's runtime. With `MSTAR_ENGINE_PROCESS=1` and a component that allows it, its
        engine runs in a child process (mstar_common/engine/engine_process.py) and the runtime holds a
        `RemoteEngine` in its place; a component that does not allow it keeps its engine here and logs why."""
        from mstar_common.engine import engine_process

        if not engine_process.enabled():
            return self.build()
        refusal = self.family.engine_process_refusal(self.component.name, self.deployment)
        if refusal is not None:
            logger.info("[%s] %s=1, but the engine stays in this process: %s", self.model_name,
                        engine_process.SWITCH, refusal)
            return self.build()
        spec = engine_process.EngineSpec(self.model_name, self.family.name, self.component.name, self.deployment,
                                         self.checkpoint, self.device, self.instance)
        return engine_process.start_engine_process(spec, on_exit=self.end_stub)

    def end_stub(self, reason: str) -> None:
        """The engine process died: end this stub too. A stub left up would answer every request it is given
        `unavailable` while its model reports ready (with several instances, Triton goes on sending it its share);
        a dead stub is what `mstar serve`'s supervisor relaunches the server for (docs/reliability.md)."""
        logger.error("[%s] the engine process is gone (%s); ending this stub so that the server is relaunched",
                     self.model_name, reason)
        time.sleep(END_STUB_GRACE_S)
        os._exit(1)


def install_stack_dumps(stats=None) -> None:
    """With `MSTAR_STACK_DUMP_S=N` set, every thread's Python stack goes to the stub's stderr (the server log)
    every N seconds: the way to see where a component is stuck without a debugger. faulthandler's C watchdog
    writes even while a thread holds the GIL; a Python thread also logs `stats()` (if given) and the stacks,
    so a log with the first but not the second means the GIL is held."""
    interval = stack_dump_s()
    if interval <= 0:
        return
    faulthandler.dump_traceback_later(interval, repeat=True, file=sys.__stderr__)

    def watch() -> None:
        while True:
            time.sleep(interval)
            frames = sys._current_frames()
            names = {t.ident: t.name for t in threading.enumerate()}
            text = "".join(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                           for ident, frame in frames.items() if ident != threading.get_ident())
            logger.warning("[watchdog] stats %s\n%s", stats() if stats else {}, text)

    threading.Thread(target=watch, name="mstar-watchdog", daemon=True).start()


def load_node(args: dict, *, kind: str) -> NodeSetup:
    """Check the Triton contract (decoupled, parameters, component kind) and resolve the checkpoint."""
    model_name = args["model_name"]
    instance = args.get("model_instance_name") or model_name
    configure_logging(instance)
    load_native_backtrace()  # MSTAR_NATIVE_BACKTRACE: native frames too; loaded first, faulthandler chains to it
    faulthandler.enable(file=sys.__stderr__, all_threads=True)  # a fatal signal leaves every stack in the log
    kill_when_orphaned()  # a stub outlives a dead server by a few seconds at most, wedged or not
    try:
        # a misspelt MSTAR_* switch refuses every model at load, not only the AR engines (an image walk loaded,
        # then answered each PNG request with MSTAR_PNG_ENCODER's error as the client's 400); every bad one named
        # at once, the switch interval among them (applied after: a bad one of it alone hid the others)
        check_switches()
        interval = apply_switch_interval()
    except ValueError as exc:
        raise pb_utils.TritonModelException(f"{model_name}: {exc}") from None
    logger.info("[%s] GIL switch interval %.3f ms", model_name, interval * 1e3)
    model_config = json.loads(args["model_config"])
    if not pb_utils.using_decoupled_model_transaction_policy(model_config):
        raise pb_utils.TritonModelException(f"{model_name}: a {kind} node must be decoupled")
    params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
    for key in ("family", "component", "deployment"):
        if key not in params:
            raise pb_utils.TritonModelException(f"{model_name}: config.pbtxt lacks parameter {key!r}")
    deployment = deployment_from_dict(json.loads(params["deployment"]), source=model_name)
    family = get_family(params["family"])
    component = family.graph.components[params["component"]]
    if component.kind != kind:
        raise pb_utils.TritonModelException(f"{model_name}: component {component.name!r} is a {component.kind!r} "
                                            f"component, not {kind!r}")
    checkpoint = resolve_checkpoint(deployment.checkpoint, family.builtin_checkpoints)
    device = f"cuda:{args['model_instance_device_id']}" if args["model_instance_kind"] == "GPU" else "cpu"
    use_device(device)  # before anything is built: kernels, streams and graphs use the current device
    return NodeSetup(model_name, deployment, family, component, checkpoint, device, instance)
