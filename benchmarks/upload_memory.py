"""The server's memory while it receives large batch files: a real ``pipepool serve`` (the
bundled MiniLM, loopback), one upload of --mb megabytes, then --parallel at once, each a
JSON Lines file generated as it is sent (the client holds none of it). The server's peak RSS
is read from /proc (VmHWM, reset before each phase through clear_refs; needs Linux and the
right to write the server's /proc/<pid>/clear_refs).

    python benchmarks/upload_memory.py                 # 120 MB, then four at once
    python benchmarks/upload_memory.py --mb 190 --parallel 4

Targets (issue 57): one 120 MB upload grows the RSS by < 60 MB; four at once by < 250 MB.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from served import start_server

BOUNDARY = "pipepool-bench"


def body(size: int):
    """A multipart form with purpose 'batch' and a file of ``size`` bytes, made as it is sent."""
    yield (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
           f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
           "filename=\"big.jsonl\"\r\n\r\n").encode()  # fmt: skip
    request = {"input": "the quick brown fox jumps over the lazy dog"}
    one = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/embeddings",
                      "body": request})  # fmt: skip
    block = (one.encode() + b"\n") * ((1 << 20) // (len(one) + 1))
    sent = 0
    while sent < size:
        piece = block[: size - sent]
        sent += len(piece)
        yield piece
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def memory(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in MiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) >> 10, int(fields["VmHWM"].split()[0]) >> 10


def upload(url: str, size: int) -> float:
    t = time.perf_counter()
    form = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    r = httpx.post(url + "/v1/files", content=body(size), timeout=600, headers=form)
    if r.status_code != 200 or r.json()["bytes"] != size:
        raise SystemExit(f"upload answered {r.status_code}: {r.text[:300]}")
    httpx.delete(url + "/v1/files/" + r.json()["id"], timeout=60)
    return time.perf_counter() - t


def phase(pid: int, url: str, size: int, count: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before, _ = memory(pid)
    with ThreadPoolExecutor(count) as pool:
        seconds = list(pool.map(lambda _: upload(url, size), range(count)))
    _, peak = memory(pid)
    print(f"{count} x {size >> 20} MB: RSS {before} MiB before, peak {peak} MiB "
          f"(+{peak - before} MiB); {max(seconds):.1f} s", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=120, help="megabytes per upload (default 120)")
    p.add_argument("--parallel", type=int, default=4, help="uploads at once, phase 2 (default 4)")
    args = p.parse_args()
    size = args.mb << 20
    with tempfile.TemporaryDirectory() as state:
        flags = ["--state-dir", state, "--max-batch-file-bytes", str(size + (1 << 20)),
                 "--max-concurrent-uploads", str(args.parallel), "--no-access-log"]  # fmt: skip
        proc, url = start_server(flags)
        try:
            phase(proc.pid, url, size, 1)
            phase(proc.pid, url, size, args.parallel)
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
