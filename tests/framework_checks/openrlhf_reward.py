"""Runs storyrl's OpenRLHF adapter through OpenRLHF's own reward client code,
in a process whose path holds a released OpenRLHF wheel (see
tests/frameworks.py). Reads a JSON job on stdin, prints one JSON line.

* ``executor`` (OpenRLHF >= 0.10.2): ``SingleTurnAgentExecutor(remote_rm_url)``
  -- the reward file loaded and called, or the URL posted to, by OpenRLHF --
  and its ``execute`` for each sample: the prompt tokenised, a stand-in engine
  "generates" the sample's response tokens (plus EOS), OpenRLHF decodes the
  query with special tokens and fetches the reward.
* ``request`` (OpenRLHF 0.8.3): ``remote_rm_utils.request_api_wrapper``, the
  HTTP client, posting the job's batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import storyrl  # noqa: F401  (installs the torchvision hook before OpenRLHF imports transformers)


class Output:
    def __init__(self, token_ids):
        self.token_ids = token_ids
        self.finish_reason = "stop"
        self.logprobs = None


class Engine:
    """vLLM's async engine as far as the executor uses it: the response is
    given (the sample's tokens, then EOS)."""

    def __init__(self, tokenizer, responses):
        self.tokenizer, self.responses = tokenizer, responses

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        result = type("RequestOutput", (), {})()
        result.outputs = [Output(self.responses.pop(0))]
        return result


class Params:
    max_tokens = 256
    logprobs = None


def tensors_to_lists(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: tensors_to_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return [tensors_to_lists(v) for v in value]
    return value


def run_executor(job):
    from openrlhf.utils.agent import SingleTurnAgentExecutor
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
    responses = [tokenizer(s, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                 for s in job["stories"]]
    executor = SingleTurnAgentExecutor(remote_rm_url=job["remote_rm_url"])
    engine = Engine(tokenizer, responses)
    outputs = []
    for prompt, label in zip(job["prompts"], job["labels"]):
        out = asyncio.run(executor.execute(prompt, label, Params(), 512, tokenizer, engine))
        outputs.append({"reward": tensors_to_lists(out["reward"]), "scores": tensors_to_lists(out["scores"]),
                        "extra_logs": tensors_to_lists(out["extra_logs"])})
    return {"outputs": outputs, "file_loaded": executor.reward_func is not None}


def run_request(job):
    from openrlhf.utils.remote_rm_utils import request_api_wrapper

    return {"answer": request_api_wrapper(job["url"], {"query": job["queries"], "prompts": job["prompts"],
                                                       "labels": job["labels"]}, try_max_times=1)}


def main():
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    job = json.loads(sys.stdin.read())
    result = {"executor": run_executor, "request": run_request}[job["mode"]](job)
    import importlib.metadata

    result["openrlhf"] = importlib.metadata.version("openrlhf")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
