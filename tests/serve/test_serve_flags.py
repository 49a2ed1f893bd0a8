"""`steploop serve`'s flags: what it refuses, what --help shows, and the ports it checks before starting."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from steploop import serve
from steploop.serve_ports import ServicePort, check_ports_free, serve_ports
from tests.integration.cluster import ROOT


def test_scheduler_address_is_refused_with_what_to_use_instead(capsys):
    with pytest.raises(SystemExit) as exited:
        serve.build_parser().parse_args(["--scheduler-address", "10.0.0.7:50051"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "serve starts its own scheduler" in err and "--scheduler-port" in err
    assert "steploop gateway --scheduler-address" in err and "steploop worker --scheduler-address" in err


def test_help_lists_no_flag_that_serve_replaces():
    text = serve.build_parser().format_help()
    assert "--scheduler-address" not in text
    assert "--scheduler-port" in text and "--worker-metrics-port" in text and "default 9091 here" in text


def test_the_children_get_serves_own_scheduler_address(monkeypatch):
    monkeypatch.setenv("STEPLOOP_SCHEDULER_ADDRESS", "10.0.0.7:50051")      # set for standalone services
    parser = serve.build_parser()
    args = parser.parse_args(["--scheduler-port", "50999"])
    args.scheduler_address = serve.own_scheduler_address(args)
    assert serve.child_environment(parser, args)["STEPLOOP_SCHEDULER_ADDRESS"] == "127.0.0.1:50999"


def test_the_ports_serve_binds_are_every_port_flag():
    args = serve.build_parser().parse_args(["--worker-metrics-port", "9092"])
    assert [(p.flag, p.port) for p in serve_ports(args)] == [
        ("--port", 8000), ("--scheduler-port", 50051), ("--metrics-port", 9091), ("--worker-metrics-port", 9092)]
    args = serve.build_parser().parse_args(["--metrics-port", "0"])          # 0 = off: nothing to bind
    assert [p.flag for p in serve_ports(args)] == ["--port", "--scheduler-port"]


def test_readme_flags_table_lists_every_port_flag():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| flag | default | meaning |"):]
    table = table[:table.index("\n\n")]
    args = serve.build_parser().parse_args(["--worker-metrics-port", "1"])
    for port in serve_ports(args):
        assert f"`{port.flag}`" in table, port.flag


def test_a_taken_port_is_refused_naming_its_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        number = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"port {number} .*--scheduler-port.*move it with --scheduler-port"):
            check_ports_free([ServicePort("--port", "api", "127.0.0.1", free()),
                              ServicePort("--scheduler-port", "grpc", "127.0.0.1", number)])
    check_ports_free([ServicePort("--scheduler-port", "grpc", "127.0.0.1", number)])     # free again


def test_two_services_on_one_port_are_refused():
    with pytest.raises(ValueError, match="--metrics-port and --port are both"):
        check_ports_free([ServicePort("--port", "api", "127.0.0.1", 18123),
                          ServicePort("--metrics-port", "metrics", "127.0.0.1", 18123)])


def test_serve_exits_2_before_starting_anything_when_a_port_is_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = subprocess.run([sys.executable, "-m", "steploop.cli", "serve", "--port", str(taken.getsockname()[1]),
                              "--metrics-port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             check=False)
    assert out.returncode == 2, out.stderr
    assert "(--port, the OpenAI API (gateway)) is not free" in out.stderr and "Traceback" not in out.stderr
    assert "started" not in out.stderr


def free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
