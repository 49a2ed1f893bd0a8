"""--disable-log-stats: every service takes it (and STEPLOOP_DISABLE_LOG_STATS), it cannot go with tracing, and
with it a request is served by gateway + scheduler + worker (in this process and event loop, fake runner) while
no metric is recorded: the gateway's /metrics (its own and the engine's) and the worker's registry have no
samples, and the scheduler logs no per-request line."""

from __future__ import annotations

import argparse
import logging

import aiohttp
import pytest

from steploop.common import metrics, observability
from steploop.gateway.config import add_cli_args as gateway_args
from steploop.gpu_worker import metrics as worker_metrics
from steploop.gpu_worker import server as worker_server
from steploop.scheduler import server as scheduler_server
from steploop.scheduler.metrics import EngineObserver, NullEngineObserver
from steploop.scheduler.server import SchedulerService
from steploop.serve import build_parser as serve_parser
from steploop.serve import validate_configs
from tests.observability.inprocess_cluster import MODEL, inprocess_cluster
from tests.observability.scrape import parse


def parsers() -> dict[str, argparse.ArgumentParser]:
    scheduler = argparse.ArgumentParser()
    scheduler_server.add_cli_args(scheduler)
    gateway = observability.add_cli_args(gateway_args(argparse.ArgumentParser()))
    return {"scheduler": scheduler, "worker": worker_server.build_parser(), "gateway": gateway,
            "serve": serve_parser()}


def test_every_service_takes_the_flag_and_its_env(monkeypatch):
    for name, parser in parsers().items():
        assert parser.parse_args([]).disable_log_stats is False, name
        assert parser.parse_args(["--disable-log-stats"]).disable_log_stats is True, name
    monkeypatch.setenv("STEPLOOP_DISABLE_LOG_STATS", "1")        # how `steploop serve` hands it to children
    for name, parser in parsers().items():
        assert parser.parse_args([]).disable_log_stats is True, name


def test_not_with_tracing():
    args = serve_parser().parse_args(["--disable-log-stats", "--otlp-traces-endpoint", "http://127.0.0.1:4317"])
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        validate_configs(args)
    observability.validate(serve_parser().parse_args(["--disable-log-stats"]))


async def one_request(tokenizer, monkeypatch) -> tuple[SchedulerService, str, list]:
    """One completion through the three services; returns the scheduler, the gateway's /metrics text and the
    worker observers built, after everything stopped."""
    built, make = [], worker_metrics.make_observer

    def keep(info):
        built.append(make(info))
        return built[-1]

    monkeypatch.setattr(worker_server, "make_observer", keep)
    async with inprocess_cluster(tokenizer) as cluster, aiohttp.ClientSession() as http:
        async with http.post(f"{cluster.base_url}/v1/completions", json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["usage"]["completion_tokens"] == 4
        async with http.get(f"{cluster.base_url}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    return cluster.scheduler, text, built


async def test_disabled_serves_and_records_nothing(tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(metrics, "ENABLED", False)
    caplog.set_level(logging.INFO, logger="steploop.scheduler.stats")
    svc, text, workers = await one_request(tokenizer, monkeypatch)
    assert isinstance(svc.loop.observer, NullEngineObserver)
    assert parse(text) == {}                                     # no sample at all, gateway's or engine's
    assert [type(w) for w in workers] == [worker_metrics.NullWorkerObserver]
    assert parse(metrics.exposition(workers[0].registry).decode()) == {}
    assert not [r for r in caplog.records if r.getMessage().startswith("finished ")]


async def test_enabled_by_default(tokenizer, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="steploop.scheduler.stats")
    svc, text, workers = await one_request(tokenizer, monkeypatch)
    assert isinstance(svc.loop.observer, EngineObserver)
    names = {name for name, _ in parse(text)}
    assert {"http_requests_total", "vllm:generation_tokens_total"} <= names
    assert [type(w) for w in workers] == [worker_metrics.WorkerObserver]
    assert [r for r in caplog.records if r.getMessage().startswith("finished ")]
