"""The Codex CLI (`codex exec`, Responses API) and Claude Code (`claude -p`, Messages API) run
unmodified against the gateway with `pagoda serve`'s defaults: only the base URL, a key and the
model are configured. The gateway listens on a loopback port over the scripted fake engine
(live_gateway.py), so the reply is known and ends (a real small model, or the fake worker's random
tokens, would run to the end of the context: the protocol, not the model, is under test here).

The CLIs are npm packages (a Node binary each, ~650 MB with their platform builds), not Python
ones: `make agent-clis` installs them into build/agent-clis, or put `codex` / `claude` on PATH.
Each test skips when its CLI is not found. Both run offline: no login, no telemetry, no update
check reaches the network (the environment below turns those off)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.gateway.live_gateway import AGENT_DEFAULTS, ANSWER, MODEL, RoundTripScripts, serve_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
REPO = Path(__file__).resolve().parents[2]
CLI_DIRS = [REPO / "build" / "agent-clis" / "node_modules" / ".bin"]


def find_cli(name: str) -> str:
    for folder in CLI_DIRS:
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (make agent-clis)")
    return found


@pytest.fixture
async def base_url(make_gateway, upstream, tokenizer):
    # Their system prompts and tool lists are long (Claude Code's: tens of thousands of tokens in
    # the tiny test tokenizer); the fake engine allocates nothing, so its context can be roomy.
    upstream.engine.max_model_len = 262144
    upstream.engine.scripts = RoundTripScripts(upstream.engine, tokenizer, calls=False)
    gateway = await make_gateway(**AGENT_DEFAULTS)
    async with serve_http(gateway.state) as url:
        yield url


async def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float = 180) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env={"PATH": os.environ["PATH"], **env}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def test_codex_exec_says_hello(base_url, upstream, tmp_path):
    codex = find_cli("codex")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "pagoda"\n\n[model_providers.pagoda]\nname = "Pagoda"\n'
        f'base_url = "{base_url}/v1"\nwire_api = "responses"\n')
    code, out, err = await _run([codex, "exec", "--skip-git-repo-check", "say hello"], work,
                                {"CODEX_HOME": str(home), "HOME": str(tmp_path)})
    assert code == 0 and ANSWER in out, f"{out}\n{err}"
    assert upstream.engine.requests  # it reached the engine through /v1/responses


async def test_claude_p_says_hello(base_url, upstream, tmp_path):
    claude = find_cli("claude")
    env = {"HOME": str(tmp_path), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
    code, out, err = await _run([claude, "-p", "say hello"], tmp_path, env)
    assert code == 0 and out.strip() == ANSWER, f"{out}\n{err}"
    # Claude Code sends max_tokens 32000 with a mid-conversation system message and its betas'
    # fields: served, max_tokens clamped to the context's room when that is smaller
    assert all(r.sampling.max_tokens <= 32000 for r in upstream.engine.requests)


def _call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


async def test_codex_exec_edits_a_file_through_its_shell_tool(make_gateway, upstream, tokenizer, tmp_path):
    """One real edit through Codex's own tool: the (scripted) model calls `exec_command`, Codex runs
    it and sends the output back as a function_call_output, the model answers."""
    codex = find_cli("codex")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    upstream.engine.max_model_len = 262144
    upstream.engine.scripts = RoundTripScripts(upstream.engine, tokenizer, call=_call(
        "exec_command", {"cmd": "echo hello > hello.txt", "workdir": str(work)}))
    gateway = await make_gateway(**AGENT_DEFAULTS)
    async with serve_http(gateway.state) as url:
        (home / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "pagoda"\n\n[model_providers.pagoda]\nname = "Pagoda"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\n')
        code, out, err = await _run([codex, "exec", "--skip-git-repo-check",
                                     "--dangerously-bypass-approvals-and-sandbox", "write hello.txt"], work,
                                    {"CODEX_HOME": str(home), "HOME": str(tmp_path)})
    assert code == 0 and ANSWER in out, f"{out}\n{err}"
    assert (work / "hello.txt").read_text() == "hello\n" and len(upstream.engine.requests) == 2


async def test_claude_p_edits_a_file_through_its_bash_tool(make_gateway, upstream, tokenizer, tmp_path):
    claude = find_cli("claude")
    work = tmp_path / "work"
    work.mkdir()
    upstream.engine.max_model_len = 262144
    upstream.engine.scripts = RoundTripScripts(upstream.engine, tokenizer, call=_call(
        "Bash", {"command": "echo hello > hello.txt", "description": "Write hello.txt"}))
    gateway = await make_gateway(**AGENT_DEFAULTS)
    async with serve_http(gateway.state) as url:
        env = {"HOME": str(tmp_path), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused",
               "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "IS_SANDBOX": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
        code, out, err = await _run([claude, "-p", "--dangerously-skip-permissions", "write hello.txt"], work, env)
    assert code == 0 and out.strip() == ANSWER, f"{out}\n{err}"
    assert (work / "hello.txt").read_text() == "hello\n"
