"""Every shell and Python example in README.md runs as written against one live `steploop serve`, each within 60 s.

The blocks are read from the README itself (readme_examples.py holds the convention: which blocks run, how a block
that must not run is marked). One server serves them all. A block runs as a user would paste it, with only the
README's ports swapped for this server's (127.0.0.1:8000 for the HTTP API, 127.0.0.1:50051 for the scheduler):
shell blocks under `bash -e` with the venv first on PATH (`steploop`, `python`) in a scratch folder that holds the
checkout's examples/, Python blocks with the venv's python; the checkout is on PYTHONPATH, so both use this tree.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from steploop.common import model_path
from tests.integration import readme_examples
from tests.integration.serve_process import ROOT, ServeProcess

EXAMPLE_TIMEOUT_S = 60
EXAMPLES = readme_examples.runnable()


def test_every_code_block_is_run_or_marked():
    """Fast: the classification alone. A block with no language, or in a shell/python dialect the test does not
    know, fails here; so does a README whose examples vanished (the parser broke)."""
    all_blocks = readme_examples.blocks()
    unlabeled = [b.line for b in all_blocks if not b.language]
    assert not unlabeled, f"README.md code fences without a language at lines {unlabeled}: label them (text, bash, " \
                          "python, ...); see tests/integration/readme_examples.py"
    shellish = [b.line for b in all_blocks if b.language in ("console", "zsh", "py", "python3", "sh-session")]
    assert not shellish, f"README.md blocks at lines {shellish}: use bash or python, so the README test runs them"
    assert len(EXAMPLES) >= 6, [b.id for b in EXAMPLES]
    assert {b.runner for b in EXAMPLES} == {"bash", "python"}
    assert any("anthropic" in b.code for b in EXAMPLES), "the Anthropic example must run"


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    server = ServeProcess(tmp_path_factory.mktemp("readme-serve"), "--num-kv-blocks", "800")
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme-run")
    (folder / "examples").symlink_to(ROOT / "examples")
    return folder


def localize(code: str, serve: ServeProcess) -> str:
    """This server's ports; and the model folder where STEPLOOP_CACHE_DIR moved it (the README names the default)."""
    model_dir = str(model_path.default_model_dir())
    return code.replace("127.0.0.1:8000", f"127.0.0.1:{serve.http_port}").replace(
        "127.0.0.1:50051", f"127.0.0.1:{serve.grpc_port}").replace(
        "~/.cache/steploop/models/SmolLM2-135M-Instruct", model_dir).replace(
        "$HOME/.cache/steploop/models/SmolLM2-135M-Instruct", model_dir)


def example_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPLOOP_")}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("block", EXAMPLES, ids=[b.id for b in EXAMPLES])
def test_readme_example_runs(block, serve, scratch):
    code = localize(block.code, serve)
    script = scratch / ("example.py" if block.runner == "python" else "example.sh")
    script.write_text(code)
    argv = [sys.executable, str(script)] if block.runner == "python" else ["bash", "-e", "-o", "pipefail", str(script)]
    started = time.monotonic()
    try:
        out = subprocess.run(argv, cwd=scratch, env=example_env(), capture_output=True, text=True,
                             timeout=EXAMPLE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"README.md line {block.line}: still running after {EXAMPLE_TIMEOUT_S} s\n{code}\n"
                    f"{(exc.stdout or b'')[-2000:]!r}\n{serve.log()[-3000:]}")
    took = time.monotonic() - started
    where = f"README.md line {block.line} ({took:.1f} s):\n{code}\nstdout: {out.stdout[-3000:]}\n" \
            f"stderr: {out.stderr[-3000:]}"
    assert out.returncode == 0, where
    assert out.stdout.strip(), f"printed nothing: {where}"
    assert '"error"' not in out.stdout, where      # curl exits 0 on an HTTP error: its body would say so
    print(f"README.md line {block.line}: {took:.1f} s")
