"""``GET /v1/jobs`` against a real Redis: a page of jobs carries no inline tasks and reads none from Redis (it read and
sent every job's whole spec, 39 MB for 20 jobs of 10k tasks, on each poll of the dashboard), while ``GET
/v1/jobs/{id}`` still has the whole spec; jobs stored before the listing's summaries (by the code before, or an older
API during a rolling upgrade) list and read as well."""

from __future__ import annotations

import json
from typing import Any

import httpx
import redis

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.task_queue import TaskQueue
from core.config import BufferConfig
from core.jobs import JobSpec
from tests.test_api import serve

TASKS = [{"task_id": f"t{i}", "messages": [{"role": "user", "content": f"What is {i}*7? " + "x" * 400}],
          "reward": {"ground_truth": str(7 * i)}} for i in range(2500)]  # three submit chunks, about 1.2 MB
INLINE = {"kind": "eval", "source": {"kind": "inline", "tasks": TASKS, "offset": 1, "limit": 2000}, "name": "big"}
# the fields of a job hash as the code before the listing's summaries stored them
STORED_BEFORE = {b"spec", b"kind", b"state", b"created", b"submitted", b"submit"}


def sent_by(r: redis.Redis) -> int:
    """Bytes Redis has sent its clients so far (INFO ``total_net_output_bytes``)."""
    return int(r.info("stats")["total_net_output_bytes"])


def listed(api: httpx.Client, r: redis.Redis) -> tuple[dict[str, Any], int]:
    """The first page of jobs, and how many bytes Redis sent while the API made it."""
    before = sent_by(r)
    reply = api.get("/v1/jobs")
    assert reply.status_code == 200, reply.text
    return reply.json(), sent_by(r) - before


def submitted(api: httpx.Client, body: dict[str, Any]) -> str:
    reply = api.post("/v1/jobs", json=body)
    assert reply.status_code == 201, reply.text
    return reply.json()["job_id"]


def as_stored(body: dict[str, Any]) -> dict[str, Any]:
    """The spec of a job submitted with ``body`` as ``GET /v1/jobs/{id}`` has it: the validated spec, whole."""
    return json.loads(JobSpec.model_validate(body).model_dump_json())


def test_the_listing_carries_no_inline_tasks_and_reads_none_from_redis(redis_server: EmbeddedRedis) -> None:
    """An inline source is listed with its kind, offset, limit and the count of its tasks, no task; Redis sends the
    page's jobs, not their tasks. Another kind's source is listed as it is stored, less ``tasks`` (null there)."""
    arith = {"source": {"kind": "arith", "limit": 3}, "n_samples": 2}
    r = redis.Redis.from_url(redis_server.url)
    with serve(redis_server.url, "listing") as api:
        inline_job, arith_job = submitted(api, INLINE), submitted(api, arith)
        page, sent = listed(api, r)
        assert sent < 50_000, f"Redis sent {sent} bytes for a page of two jobs"
        by_id = {job["job_id"]: job for job in page["jobs"]}
        source = by_id[inline_job]["spec"]["source"]
        assert source == {"kind": "inline", "path": None, "split": None, "limit": 2000, "offset": 1, "seed": 0,
                          "task_count": len(TASKS)}
        assert by_id[inline_job]["spec"]["name"] == "big" and by_id[inline_job]["progress"]["submitted"] == 2000
        arith_spec = as_stored(arith)
        del arith_spec["source"]["tasks"]
        assert by_id[arith_job]["spec"] == arith_spec
        whole = api.get(f"/v1/jobs/{inline_job}").json()
        assert whole["spec"] == as_stored(INLINE) and len(whole["spec"]["source"]["tasks"]) == len(TASKS)
        assert {**whole, "spec": None} == {**by_id[inline_job], "spec": None}  # the rest of the job as listed
        assert api.get(f"/v1/jobs/{arith_job}").json()["spec"] == as_stored(arith)
        before = sent_by(r)
        polled = api.get(f"/v1/jobs/{inline_job}", params={"summary": "true"})  # what rollwave submit --wait polls
        assert polled.status_code == 200, polled.text
        assert polled.json() == by_id[inline_job] and sent_by(r) - before < 50_000


def test_a_job_stored_before_summaries_lists_and_reads_as_before(redis_server: EmbeddedRedis) -> None:
    """A job hash as the code before stored it (no ``spec_summary``: this API's own with it deleted) lists with the
    same summary: the first listing reads its spec once and keeps the summary, later ones read no tasks. Its spec
    reads whole as it did, for the API and for a rollout worker (``TaskQueue.job``). A job stored without a spec
    (``TaskQueue.submit`` without one) lists with none, and its hash is left as it is."""
    r = redis.Redis.from_url(redis_server.url)
    keys = Keys("before")
    with serve(redis_server.url, "before") as api:
        job = submitted(api, INLINE)
        r.hdel(keys.job(job), "spec_summary")
        assert set(r.hkeys(keys.job(job))) == STORED_BEFORE
        TaskQueue(r, keys, BufferConfig()).submit("nospec", [TASKS[0]], "eval")
        bare = r.hgetall(keys.job("nospec"))
        page, first = listed(api, r)
        assert first > 1_000_000  # its spec, read once
        by_id = {j["job_id"]: j for j in page["jobs"]}
        assert by_id[job]["spec"]["source"]["task_count"] == len(TASKS) and by_id["nospec"]["spec"] is None
        assert r.hexists(keys.job(job), "spec_summary") and r.hgetall(keys.job("nospec")) == bare
        again, sent = listed(api, r)
        assert again == page and sent < 50_000
        assert api.get(f"/v1/jobs/{job}").json()["spec"] == as_stored(INLINE)
    stored = TaskQueue(r, keys, BufferConfig()).job(job)["spec"]  # what a worker's _job_spec validates
    assert JobSpec.model_validate_json(stored).source.tasks == JobSpec.model_validate(INLINE).source.tasks
