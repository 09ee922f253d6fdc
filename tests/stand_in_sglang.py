"""A stand-in for `python -m sglang.launch_server` (tests/rl/test_server_group.py): takes the launcher's flags, answers
`/health` on `--host`/`--port`, and misbehaves on demand with `--stand-in MODE`: `healthy` (default), `exit` (an
error message and status 3 at once), `never-healthy` (listens, answers /health 503), `sleep` (never listens),
`die-after` (healthy, then exits after `--stand-in-delay` seconds), `rl` (the RL tests' protocol stand-in
`tests.rl_stand_in.StandIn` on the launcher's flags: generation, records, weight updates through SGLang's receiving
code, a rank of the weight-update group, memory release / resume). `--stand-in-child` forks a child process that
sleeps (as SGLang's scheduler processes do), and every process writes its pid to `--stand-in-pids`. With
`--enable-memory-saver` it first runs what SGLang's launcher runs for that flag, which exits without the
torch_memory_saver package (CUDA only), unless `--stand-in-fake-memory-saver` stands in for the package."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--stand-in", default="healthy")
    ap.add_argument("--stand-in-delay", type=float, default=1.0)
    ap.add_argument("--stand-in-child", action="store_true")
    ap.add_argument("--stand-in-pids", default="")
    ap.add_argument("--stand-in-fake-memory-saver", action="store_true")
    args, rest = ap.parse_known_args()
    print(f"stand-in server: port {args.port}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
    print("argv " + json.dumps(sys.argv[1:]), flush=True)
    if args.stand_in_pids:
        with open(args.stand_in_pids, "a") as f:
            f.write(f"{os.getpid()}\n")
    if args.stand_in_child:
        code = (
            f"import os,time; open({args.stand_in_pids!r}, 'a').write(f'{{os.getpid()}}\\n'); print(flush=True); "
            "time.sleep(3600)"
        )
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        child.stdout.readline()  # its pid is recorded before this server can answer /health
    # the checkout's root on the path instead of this script's folder, whose tests/sglang/ and tests/megatron/
    # would shadow the sglang and megatron packages
    here = Path(__file__).resolve().parent
    sys.path[:] = [str(here.parent)] + [p for p in sys.path if Path(p or ".").resolve() != here]
    if "--enable-memory-saver" in rest and not args.stand_in_fake_memory_saver:
        # what SGLang's launcher does first with the flag (engine.py, _launch_scheduler_processes): without the
        # torch_memory_saver package it logs a warning and raises the ImportError, and the server exits
        from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

        TorchMemorySaverAdapter.create(enable=True)
    if args.stand_in == "exit":
        print("RuntimeError: stand-in: CUDA error: invalid device ordinal", flush=True)
        sys.exit(3)
    if args.stand_in == "sleep":
        time.sleep(3600)
    if args.stand_in == "rl":  # heavy imports (torch, SGLang, the engine) for this mode only
        from tests.rl_stand_in import serve

        serve(sys.argv[1:])
        return
    healthy = args.stand_in != "never-healthy"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/health" and healthy
            self.send_response(200 if ok else 503)
            self.end_headers()

        def log_message(self, *a) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    if args.stand_in == "die-after":
        threading.Timer(args.stand_in_delay, lambda: os._exit(4)).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
