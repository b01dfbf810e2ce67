"""scripts/inspect_post_wait.py's count of what a kernel does after its PDL wait, on hand-written PTX (the script
itself needs Triton's NVIDIA backend; its parsing does not)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "inspect_post_wait.py"
spec = importlib.util.spec_from_file_location("inspect_post_wait", SCRIPT)
inspect_post_wait = importlib.util.module_from_spec(spec)
spec.loader.exec_module(inspect_post_wait)

PTX = """
    ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];   // a weight, ahead of the wait: not counted
    griddepcontrol.wait ;
    griddepcontrol.launch_dependents ;
    ld.global.v2.b32 {%r5, %r6}, [%rd2];
    ld.global.v2.b32 {%r7, %r8}, [%rd3];
    shfl.sync.bfly.b32 %r9, %r5, 16, 31, -1;
    st.shared.b32 [%r10], %r9;
    bar.sync 0;
    ld.shared.b32 %r11, [%r10];
    ld.global.b32 %r12, [%rd4];
    st.global.b16 [%rd5], %rs1;
    ld.global.b32 %r13, [%rd6];
    ret;
"""


def test_counts_only_what_follows_the_wait_and_the_serial_trips():
    counts = inspect_post_wait.after_wait(PTX)
    assert counts["global loads"] == 4 and counts["global stores"] == 1
    assert counts["shared stores"] == 1 and counts["shared loads"] == 1
    assert counts["CTA barriers"] == 1 and counts["warp shuffles"] == 1
    assert counts["load trips"] == 3  # two loads together; one behind the barrier; one behind the store


def test_a_kernel_without_a_wait_says_so():
    assert inspect_post_wait.after_wait("ld.global.b32 %r1, [%rd1];\nret;") == {"no PDL wait": 1}
