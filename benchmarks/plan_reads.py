"""A plan's reads of an object store: how long `batchvl run` takes to find a finished job's shards done.

A plan reads a few small objects per shard (its marker, its output's size, its input's stamp). This runs a
job of `--shards` one-sample shards on the `tiny` model into an S3 output served by moto on 127.0.0.1, then
times the plan that a rerun of the same command makes, with the shards read one at a time and
`RemoteDir.reads_at_once` (`READS_AT_ONCE`) at a time, alternated. moto answers on the same machine in a
few milliseconds of its own CPU; `--latency-ms` delays each request by that much in the client
(asyncio.sleep before it is sent), standing for the round trip to a cloud region's store, so that the
figures say what the waits cost, not what a given cloud's store answers. The requests are counted in the
client.

    python benchmarks/plan_reads.py [--shards 200] [--latency-ms 20] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import tempfile
import time
from pathlib import Path

from workloads import markdown_table, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=200)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2, help="plans timed at each setting, alternated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import aiobotocore.endpoint
    import boto3
    import pyarrow as pa
    import pyarrow.parquet as pq
    from moto.server import ThreadedMotoServer
    from PIL import Image

    from batchvl.config import load_job_config
    from batchvl.demo.tiny_model import build_tiny_model
    from batchvl.models.loader import load_model
    from batchvl.pipeline.plan import plan_job
    from batchvl.pipeline.runner import run_job
    from batchvl.storage.output_dir import RemoteDir

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # (moto's server logs every request)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys).create_bucket(Bucket="plans")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        image = io.BytesIO()
        Image.new("RGB", (40, 40), (120, 60, 30)).save(image, format="PNG")
        for i in range(args.shards):
            shard = pa.table({"key": [f"k{i}"], "image": [image.getvalue()]})
            pq.write_table(shard, root / "data" / f"part-{i:05d}.parquet")
        model = build_tiny_model(root / "model", size="tiny", seed=0)
        (root / "job.yaml").write_text(
            f"model: {{path: {model}, dtype: float32, device: cpu}}\n"
            'input: {paths: ["data/*.parquet"], key_column: key}\n'
            "prompts: [{name: caption, text: Describe this image.}]\n"
            "sampling: {max_new_tokens: 1}\n"
            "preprocess: {workers: 0}\n"
            f"output: {{dir: 's3://plans/out', storage_options: {{endpoint_url: '{endpoint}', key: testing,"
            " secret: testing}}\n"
        )
        cfg = load_job_config(root / "job.yaml")
        run_job(cfg, loaded=load_model(str(model), dtype="float32", device="cpu"), show_progress=False)

        requests = [0]
        send = aiobotocore.endpoint.AioEndpoint._send

        async def delayed(endpoint_self, request):
            requests[0] += 1
            await asyncio.sleep(args.latency_ms / 1000)
            return await send(endpoint_self, request)

        aiobotocore.endpoint.AioEndpoint._send = delayed
        rows = []
        default = RemoteDir.reads_at_once
        for _ in range(args.rounds):
            for at_once in (1, default):
                RemoteDir.reads_at_once = at_once
                requests[0] = 0
                started = time.perf_counter()
                plan = plan_job(cfg, record=True, model_loaded=True)
                seconds = time.perf_counter() - started
                assert plan.resume.num_done == args.shards, "the job's shards were not all found done"
                rows.append(
                    {"shards": args.shards, "latency_ms": args.latency_ms, "reads_at_once": at_once}
                    | {"plan_s": round(seconds, 2), "requests": requests[0]}
                )
        RemoteDir.reads_at_once = default
    server.stop()
    print(markdown_table(rows))
    write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
