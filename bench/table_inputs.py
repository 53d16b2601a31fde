"""Peak memory of validating a Parquet batch file of 1M rows, against 100k rows, each in a fresh process.

Validation reads a table input in record batches (io/table_inputs.py), so its peak memory must stay
flat as the row count grows: the figure is the ratio of the 1M-row peak to the 100k-row peak
(1.0 = flat); the process's peak before it validates anything (imports only) is printed beside it.
Also prints rows/s. Each size runs in its own subprocess, so one peak does not hide another.

    .venv/bin/python bench/table_inputs.py                   # 100k and 1M rows (about 1-2 min on 2 cores)
    .venv/bin/python bench/table_inputs.py --rows 100000 2000000 --json /tmp/tables.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from batch_pipeline.io import storage
from batch_pipeline.steps.ingest import validate_batch
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.steps.validation import ValidationSettings

def rss_mb():
    # VmHWM: this program's peak since exec (ru_maxrss would include the parent's RSS at fork).
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

source, out = sys.argv[1], sys.argv[2]
base = rss_mb()
loc = BatchLocation("rows", source, out, "2026-11-30")
started = time.perf_counter()
info = validate_batch(loc, ValidationSettings(served_model_name="m", embedding_model_name=None))
seconds = time.perf_counter() - started
print(json.dumps({"rows": info["lines"], "valid": info["valid"], "seconds": round(seconds, 2),
                  "baseline_mb": round(base, 1), "peak_mb": round(rss_mb(), 1)}))
"""


def make_table(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("custom_id", pa.string()), ("prompt", pa.string()), ("max_tokens", pa.int64()),
                        ("product_id", pa.int64()), ("category", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            ids = range(start, start + n)
            writer.write_table(pa.table({
                "custom_id": [f"row-{i}" for i in ids],
                "prompt": [f"Summarise the feedback of customer {i}: the delivery was late and the box was damaged." for i in ids],
                "max_tokens": [64] * n, "product_id": list(ids), "category": [("books", "toys", "tools")[i % 3] for i in ids],
            }, schema=schema))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    figures = []
    with tempfile.TemporaryDirectory(prefix="bench-tables-") as tmp:
        for rows in args.rows:
            source = Path(tmp) / f"rows-{rows}.parquet"
            make_table(source, rows)
            done = subprocess.run([sys.executable, "-c", CHILD, str(source), str(Path(tmp) / f"out-{rows}")],
                                  capture_output=True, text=True, check=True)
            figure = json.loads(done.stdout.strip().splitlines()[-1])
            figure["file_mb"] = round(source.stat().st_size / 2**20, 1)
            figure["rows_per_second"] = round(figure["rows"] / figure["seconds"]) if figure["seconds"] else 0
            figures.append(figure)
            print(f"{rows:>9,} rows ({figure['file_mb']} MB Parquet): validated in {figure['seconds']} s "
                  f"({figure['rows_per_second']:,} rows/s), peak RSS {figure['peak_mb']} MB "
                  f"(imports alone: {figure['baseline_mb']} MB)", flush=True)
    small, large = figures[0], figures[-1]
    print(f"peak RSS {large['rows']:,} rows / {small['rows']:,} rows: {large['peak_mb'] / small['peak_mb']:.2f}x "
          f"for {large['rows'] / small['rows']:.0f}x the rows (1.00x = flat)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
