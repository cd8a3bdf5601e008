"""The fake OpenAI server (tests/fake_openai_server.py) as a program, for `engine.server.launch` in tests:
it takes the arguments batchvl gives vLLM's server (`--model`, `--dtype`, `--served-model-name`, `--host`,
`--port`) and serves until it is stopped; a flag `--bogus...` is refused as a server refuses a flag it does
not know. `--exit-on MARKER`: a request holding MARKER makes the process
exit at once, unanswered (a request that crashes the server); `--hold-s S`: every completion waits S
seconds; `--reject-probes`: planning's probes are refused (HTTP 400); `--slow-models-s S`: `GET /v1/models`
waits S seconds before answering."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchvl.pipeline.server_setup import PROBE_TEXT  # noqa: E402
from tests.fake_openai_server import FakeOpenAIServer, request_text  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--dtype")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-on", action="append", default=[])
    parser.add_argument("--hold-s", type=float, default=0.0)
    parser.add_argument("--reject-probes", action="store_true")
    parser.add_argument("--slow-models-s", type=float, default=0.0)
    args, others = parser.parse_known_args()  # what a real server takes besides (--max-model-len, --api-key)
    bogus = [arg for arg in others if arg.startswith("--bogus")]
    if bogus:  # as vLLM's server: its long usage text, then the error, on a flag it does not know
        print(
            "usage: api_server.py " + " ".join(f"[--option-{i} VALUE]" for i in range(200)), file=sys.stderr
        )
        parser.error(f"unrecognized arguments: {' '.join(others)}")
    server = FakeOpenAIServer(args.served_model_name or args.model, port=args.port)
    answer = server.completion

    def completion(body: dict):
        if any(marker in request_text(body) for marker in args.exit_on):
            print(f"exiting on {request_text(body)!r}", flush=True)
            os._exit(3)
        return answer(body)

    server.completion = completion
    server.hold_s = args.hold_s
    server.slow_models_s = args.slow_models_s
    if args.reject_probes:
        server.reject[PROBE_TEXT] = "this server takes no structured_outputs"
    print(f"serving {server.models} at {server.url} (pid {os.getpid()})", flush=True)
    with server:
        threading.Event().wait()


if __name__ == "__main__":
    main()
