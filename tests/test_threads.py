"""commsched's background threads carry their own name for the operating system."""

import sys
import threading
from pathlib import Path

import pytest

from commsched.threads import start_thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names via /proc")
def test_started_thread_has_its_os_name_and_python_name():
    seen = {}
    release = threading.Event()

    def body():
        seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
        release.wait(10)

    thread = start_thread(body, "commsched-g7-dispatch", "cs-g7-dispatch-and-more")
    try:
        for _ in range(200):
            if "comm" in seen:
                break
            threading.Event().wait(0.01)
        assert seen["comm"].strip() == "cs-g7-dispatch-"      # the kernel keeps 15 bytes
        assert thread.name == "commsched-g7-dispatch" and thread.daemon
        # the creating thread keeps its own OS name
        own = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        assert own != "cs-g7-dispatch-"
    finally:
        release.set()
        thread.join(10)
