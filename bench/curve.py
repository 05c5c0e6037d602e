"""Benchmark: what CURVE encryption costs on the segment path, against plain TCP measured in the same run.

A PUSH in one process sends segment-sized messages to a PULL in another over loopback TCP, as fast as the
socket takes them, for ``--seconds`` each: run A plain, run B with CURVE (server keys + ZAP allowlist, as
every zclaw server socket has them). Prints both rates and the ratio B / A.

    python bench/curve.py [--seconds 4] [--kb 133]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple

import zmq

from zclaw import config
from zclaw.security import Security
from zclaw.tools.keys import default_names, generate
from zclaw.wire.sockets import CurveClient, make_socket, term_context


def _push(port: int, size: int, seconds: float, curve: Optional[CurveClient]) -> None:
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.PUSH, hwm=64, curve=curve)
    sock.connect(f"tcp://127.0.0.1:{port}")
    payload = b"\x01" * size
    end = time.monotonic() + seconds + 2.0  # the puller decides when the measurement ends
    while time.monotonic() < end:
        try:
            sock.send(payload, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            time.sleep(0.0005)
    sock.close(linger=0)
    ctx.term()


def run(size: int, seconds: float, keys: Optional[Path]) -> Tuple[float, float]:
    """(messages/s, MB/s) received by the PULL side."""
    cfg = config.load(values={"security.keys_dir": str(keys)} if keys else {})
    server = Security.from_config(cfg, "broker").server()
    client = Security.from_config(cfg, "worker").client("broker")
    ctx = zmq.Context()
    pull = make_socket(ctx, zmq.PULL, hwm=64, curve=server)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=_push, args=(port, size, seconds, client))
    proc.start()
    pull.recv()  # connected and handshaken: start the clock
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        if pull.poll(100):
            pull.recv(copy=False)
            n += 1
    dt = time.monotonic() - t0
    proc.join(10)
    pull.close(linger=0)
    term_context(ctx)
    return n / dt, n * size / dt / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--kb", type=int, default=133,
                    help="message size in KiB (133: a 64 x 16 Reacher segment)")
    args = ap.parse_args()
    size = args.kb << 10
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        generate(keys, default_names(1))
        plain = run(size, args.seconds, None)
        curve = run(size, args.seconds, keys)
    print(f"message {args.kb} KiB, {args.seconds:.0f} s each")
    print(f"  plain TCP : {plain[0]:9.0f} msg/s  {plain[1]:8.1f} MB/s")
    print(f"  CURVE     : {curve[0]:9.0f} msg/s  {curve[1]:8.1f} MB/s")
    print(f"  ratio CURVE / plain: {curve[1] / plain[1]:.2f}")


if __name__ == "__main__":
    main()
