"""A tiny stand-in engine for node-manager tests: answers 200 on every GET.

    fake_engine.py --host H --port P [--ignore-sigterm | --sigterm-exit-status N] [--child-pid-file F]
                   [--exit-after S] [--healthy-after S] [--pid-file F] [any other --flags]

``--child-pid-file``: spawn a child (same process group) that ignores SIGTERM and write its
pid there (to test that the whole group is killed).
"""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--ignore-sigterm", action="store_true")
p.add_argument("--sigterm-exit-status", type=int, help="exit with this status on SIGTERM")
p.add_argument("--child-pid-file")
p.add_argument("--pid-file")
p.add_argument("--exit-after", type=float)
p.add_argument("--exit-status", type=int, default=3)
p.add_argument("--healthy-after", type=float, default=0.0)
args, _unknown = p.parse_known_args()

if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif args.sigterm_exit_status is not None:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(args.sigterm_exit_status))
if args.pid_file:
    with open(args.pid_file, "w") as f:
        f.write(str(os.getpid()))
if args.child_pid_file:
    child = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "time.sleep(600)"])
    with open(args.child_pid_file, "w") as f:
        f.write(str(child.pid))
T0 = time.monotonic()


class H(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = time.monotonic() - T0 >= args.healthy_after
        body = b'{"ok": true}' if ok else b'{"ok": false}'
        self.send_response(200 if ok else 503)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: object) -> None:
        pass


srv = ThreadingHTTPServer((args.host, args.port), H)
srv.daemon_threads = True
if args.exit_after is not None:
    def _exit() -> None:
        time.sleep(args.exit_after)
        os._exit(args.exit_status)
    threading.Thread(target=_exit, daemon=True).start()
print(f"fake engine on {args.host}:{args.port}", flush=True)
srv.serve_forever()
