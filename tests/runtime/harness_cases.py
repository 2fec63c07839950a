"""The harness command of tests/runtime/test_harness.py: one behaviour per episode, chosen by (group, index) of the
task it is given — a crash after one completion, a hang, malformed JSON, no finish, a reward off the task's spec,
and well-behaved episodes (the real ``openai`` client, ``logprobs`` requested) that record every completion's
sampled token ids and log-probs in ``$TSYNC_TEST_RECORD/EPISODE.json`` and finish with or without their own reward."""

import json
import os
import sys
import time
import urllib.error
import urllib.request

import httpx
import openai

CASES = {(0, 0): "crash", (0, 1): "hang", (1, 0): "bad_json", (1, 1): "no_finish", (2, 0): "reward:1",
         (2, 1): "reward:5", (3, 0): "reward:1", (3, 1): "verifier"}


def main() -> None:
    task, eid, url = json.loads(os.environ["TSYNC_TASK"]), os.environ["TSYNC_EPISODE_ID"], os.environ["OPENAI_BASE_URL"]
    case = CASES.get((task["group"], task["index"]), "verifier")
    if case == "hang":
        time.sleep(3600)
    if case == "bad_json":
        req = urllib.request.Request(f"{url}/chat/completions", data=b'{"model": "tsync-policy", "messages": [',
                                     headers={"X-Episode-Id": eid, "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as e:
            assert e.code == 400, e.code
        return
    client = openai.OpenAI(base_url=url, max_retries=0, default_headers={"X-Episode-Id": eid})
    comp = client.chat.completions.create(model=os.environ["TSYNC_MODEL"], logprobs=True,
                                          messages=[{"role": "user", "content": task["prompt"]}])
    record = [{"ids": comp.model_extra["tsync"]["completion_token_ids"],
               "logprobs": [t.logprob for t in comp.choices[0].logprobs.content]}]
    if case == "crash":
        print("boom: the harness crashed", file=sys.stderr)
        sys.exit(3)
    if case == "no_finish":
        return
    with open(os.path.join(os.environ["TSYNC_TEST_RECORD"], f"{eid}.json"), "w") as f:
        json.dump(record, f)
    body = {"metadata": {"reward": float(case.split(":")[1])}} if case.startswith("reward:") else {}
    client.post(f"/episodes/{eid}/finish", body=body, cast_to=httpx.Response)


if __name__ == "__main__":
    main()
