"""`tether serve-rm` and `--reward-url` (issue 34): a served reward model scores exactly as the
same model in process, a run with --reward-url is the run with --reward-model, and every way an
endpoint fails (dead, 500, hung, another model, no chat template) is one line, never a silent
zero.

The truth for the scores is the in-process reward model (`load_scoring_model(...).score_texts`,
what `--reward-model` uses for a model that reads text) with the same rows per forward: equal to
the last bit, since the server runs that very function on the same rows.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import sample_texts
from offline_fixtures import RM_TEMPLATE, write_jsonl
from processes import pinned_threads, same_settings_env
from refusals import refused
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, GPT2Config, LlamaConfig

from tether.cli import main
from tether.errors import TetherError
from tether.models.pretrained import load_tokenizer
from tether.models.reward_model import RewardModel
from tether.models.tiny import EOS, make_llama_tokenizer, make_tokenizer
from tether.rl.reward import NonFiniteScore
from tether.rl.reward import remote as remote_reward
from tether.rl.reward.models import load_scoring_model
from tether.rl.reward.remote import connect, score_remote
from tether.tools.config import ServeRMConfig
from tether.tools.serve_rm import open_server, serve

CHATS = [[{"role": "user", "content": "the movie was"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a long plot and"}],
         [{"role": "user", "content": "it"}],
         [{"role": "user", "content": "the ending was very"}]]
PLAIN = ["the movie was", "a film with a long plot and", "it", "the ending was very"]
RESPONSES = [" good fun.", " the actor was great and the music loved it", " it", " dull."]


@pytest.fixture(scope="module")
def rms(tmp_path_factory, tiny_model_dir):
    """Three reward models: `tether` (a `tether rm`-style model on the tiny GPT-2, normalised),
    `gpt2` (a hub GPT2ForSequenceClassification, no chat template, pad = EOS) and `llama` (a hub
    LlamaForSequenceClassification with its own chat template and no pad id)."""
    root = tmp_path_factory.mktemp("served_rms")
    other = [t.upper() + " " + t for t in sample_texts(200, seed=11)]
    tok = make_tokenizer(other, vocab_size=200)
    tok.pad_token = EOS
    torch.manual_seed(1)
    gpt2 = AutoModelForSequenceClassification.from_config(GPT2Config(
        vocab_size=len(tok), n_layer=2, n_embd=32, n_head=2, n_positions=128, num_labels=1,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id))
    ltok = make_llama_tokenizer(other, vocab_size=260)
    ltok.chat_template = RM_TEMPLATE
    torch.manual_seed(2)
    llama = AutoModelForSequenceClassification.from_config(LlamaConfig(
        vocab_size=len(ltok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
        bos_token_id=ltok.bos_token_id, eos_token_id=ltok.eos_token_id))
    for name, model, tokenizer in (("gpt2", gpt2, tok), ("llama", llama, ltok)):
        with torch.no_grad():  # a random head of std 0.02 gives near-equal scores; spread them
            model.score.weight.normal_(0.0, 1.0)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    policy_tok = load_tokenizer(str(tiny_model_dir))
    torch.manual_seed(3)
    own = RewardModel.from_causal_lm(str(tiny_model_dir), policy_tok)
    own.set_normalization(0.25, 2.0)
    own.save_pretrained(root / "tether", policy_tok)
    return {name: root / name for name in ("tether", "gpt2", "llama")}


@contextmanager
def served(path, batch_size: int = 4, dtype: str = "float32"):
    """`tether serve-rm PATH` in this process, on a free port, for the block's length."""
    server = open_server(ServeRMConfig(model=str(path), port=0, device="cpu",
                                       batch_size=batch_size, dtype=dtype))
    thread = serve(server)
    try:
        yield server
    finally:
        server.stop()
        thread.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("which, prompts", [("tether", PLAIN), ("gpt2", PLAIN), ("llama", PLAIN),
                                            ("llama", CHATS)])
def test_served_scores_equal_the_in_process_models_exactly(rms, which, prompts):
    in_process = load_scoring_model(str(rms[which]), "cpu")
    with served(rms[which], batch_size=4) as one, served(rms[which], batch_size=4) as two:
        endpoints = connect([one.url])
        got = score_remote(endpoints, prompts, RESPONSES, timeout=60)
        # the same rows per forward (all 4), the same function: equal to the last bit
        assert got.tolist() == in_process.score_texts(prompts, RESPONSES, 4).tolist()
        # two endpoints: rows 0-1 to one, 2-3 to the other, each part one forward of 2 rows, as
        # the in-process model scores with 2 rows per forward
        both = score_remote(connect([one.url, two.url]), prompts, RESPONSES, timeout=60)
        assert both.tolist() == in_process.score_texts(prompts, RESPONSES, 2).tolist()
        # and against one endpoint: a row's score does not depend on its batch (right padding;
        # float32 rounding of a matmul of another shape is the only difference allowed)
        torch.testing.assert_close(both, got, rtol=1e-5, atol=1e-6)
    assert len(set(got.tolist())) == len(got)  # the texts really score apart


def test_serve_rm_loads_and_scores_as_told(rms, monkeypatch):
    # every option reaches what it sets: where it listens, the loader, the rows per forward
    from tether.tools import serve_rm

    seen = {}
    real_load, real_device = serve_rm.load_scoring_model, serve_rm.resolve_device
    monkeypatch.setattr(serve_rm, "resolve_device",
                        lambda name: seen.setdefault("device", name) and real_device("cpu"))
    monkeypatch.setattr(serve_rm, "load_scoring_model", lambda path, device, dtype, trust: (
        seen.update(path=path, dtype=dtype, trust=trust) or real_load(path, device, dtype, trust)))
    real_threads = serve_rm.use_threads
    monkeypatch.setattr(serve_rm, "use_threads", lambda requested, model, device: (
        seen.update(threads=real_threads(requested, model, device))))
    port = free_port()
    threads = torch.get_num_threads()
    server = open_server(ServeRMConfig(model=str(rms["llama"]), host="127.0.0.2", port=port,
                                       device="cpu", dtype="bfloat16", batch_size=3,
                                       trust_remote_code=True, threads=threads + 1))
    torch.set_num_threads(threads)  # this process's again (the server set its own)
    sizes = []
    score_texts = server.model.score_texts
    monkeypatch.setattr(server.model, "score_texts", lambda p, r, batch_size, **kw: (
        sizes.append(batch_size) or score_texts(p, r, batch_size, **kw)))
    thread = serve(server)
    try:
        assert server.url == f"http://127.0.0.2:{port}"
        endpoints = connect([server.url])
        score_remote(endpoints, PLAIN, RESPONSES, timeout=60)
    finally:
        server.stop()
        thread.join()
    assert seen == {"device": "cpu", "path": str(rms["llama"]), "dtype": "bfloat16",
                    "trust": True, "threads": threads + 1}
    assert sizes == [3, 3] and endpoints[0].info["dtype"] == "bfloat16"  # rows 0-2, then 3
    assert server.model.model.dtype == torch.bfloat16


def test_info_says_what_the_client_checks(rms):
    with served(rms["llama"]) as server, served(rms["gpt2"]) as other:
        info = connect([server.url])[0].info
        # the model by its directory's name: its path would say where the server's files are
        assert info["model"] == "llama" and info["kind"] == "classifier"
        assert info["chat_template"] is True and info["max_length"] == 256
        assert info["dtype"] == "float32" and info["batch_size"] == 4
        assert len(info["tokenizer"]) == 16 and len(info["fingerprint"]) == 16
        gpt2 = connect([other.url])[0].info
        assert gpt2["chat_template"] is False and gpt2["fingerprint"] != info["fingerprint"]
        # a bad body is HTTP 400 with one line
        request = urllib.request.Request(server.url + "/score", data=b'{"prompts": ["a"]}')
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 400
        assert "responses" in json.loads(caught.value.read())["error"]


@pytest.mark.across_processes
def test_the_cli_serves_until_sigterm(rms):
    # The same computation on both sides (tests/processes.py): the server scores with this
    # process's thread count, so its scores are this process's bit for bit, on any CPU (with
    # another count a CPU may round the reductions otherwise: issue 49).
    child = subprocess.Popen([sys.executable, "-m", "tether", "serve-rm", str(rms["gpt2"]),
                              "--port", "0", "--device", "cpu", "--batch-size", "4",
                              *pinned_threads()],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=same_settings_env())
    try:
        ready = ""
        while not ready.startswith("serving"):
            ready = child.stdout.readline()
            assert ready, child.stderr.read()
        url = ready.split(" on ")[1].split()[0]
        assert ready == f"serving {rms['gpt2']} on {url} (POST /score)\n"
        got = score_remote(connect([url]), PLAIN, RESPONSES, timeout=60)
        expected = load_scoring_model(str(rms["gpt2"]), "cpu").score_texts(PLAIN, RESPONSES, 4)
        assert got.tolist() == expected.tolist()
        child.terminate()  # SIGTERM: a clean stop
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err
    assert out.strip() == f"stopped serving {rms['gpt2']} (SIGTERM)" and err == ""


def _run(stage_argv: list[str], root: Path) -> tuple[list[dict], dict]:
    assert main(stage_argv + ["--output-dir", str(root)]) == 0
    run = root / "r"
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
               for line in (run / "metrics.jsonl").read_text().splitlines()]
    return metrics, load_file(str(run / "final" / "model.safetensors"))


@pytest.mark.parametrize("stage, policy, rm, chat, extra", [
    ("grpo", "tiny_model_dir", "gpt2", False, []),
    ("grpo", "tiny_llama_dir", "llama", True, []),
    ("ppo", "tiny_model_dir", "gpt2", False, []),
    # sampled ahead: the server scores batch 2 in the background, during batch 1's update; the
    # reward model in process scores it when the batch is taken
    ("grpo", "tiny_model_dir", "gpt2", False, ["--max-staleness", "1",
                                               "--generator-threads", "1"]),
])
def test_online_run_with_reward_url_is_the_run_with_reward_model(stage, policy, rm, chat, extra,
                                                                 rms, request, tmp_path):
    # ppo: gae with a separate critic, which starts from the policy's trunk with either reward
    # (this reward model reads another vocabulary, so in process it cannot seed the critic either)
    rows = [{"messages": c} for c in CHATS] if chat else [{"prompt": p} for p in PLAIN]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    argv = [stage, "--policy", str(request.getfixturevalue(policy)), "--prompts", str(prompts),
            "--run-name", "r", "--batch-size", "4", "--total-episodes", "8",
            "--max-new-tokens", "6", "--device", "cpu", "--save-every", "0", "--report-to",
            "none"] + (["--samples-per-prompt", "2"] if stage == "grpo" else []) + extra
    local = _run(argv + ["--reward-model", str(rms[rm])], tmp_path / "local")
    # the server scores 4 rows per forward: the stage's micro-batch (the whole batch of 4)
    with served(rms[rm], batch_size=4) as server:
        remote = _run(argv + ["--reward-url", server.url], tmp_path / "remote")
    assert remote[0] == local[0]  # every metric, every batch
    assert remote[1].keys() == local[1].keys()
    assert all(torch.equal(remote[1][k], local[1][k]) for k in local[1])
    assert len({m["objective/score"] for m in local[0] if "objective/score" in m}) == 2
    recorded = (tmp_path / "remote" / "r" / "config.yaml").read_text()
    assert f"reward_url: {server.url}\n" in recorded  # as given: a URL, not a path


def baseline_argv(command: str, model, out) -> list[str]:
    """`tether <command>` of `model` writing `out`: eval's record; bon's curve (a pool of 2);
    interpolate's line from the model to itself (its points' records in the directory `out`)."""
    if command == "interpolate":
        return [command, "--from", str(model), "--to", str(model), "--points", "0,1",
                "--output-dir", str(out)]
    return [command, "--model", str(model), "--output", str(out),
            *(["--n", "2"] if command == "bon" else [])]


@pytest.mark.parametrize("command", ["eval", "bon", "interpolate"])
def test_eval_with_reward_url_scores_as_with_reward_model(command, rms, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PLAIN])
    argv = ["--prompts", str(prompts), "--max-new-tokens", "6", "--device", "cpu",
            "--batch-size", "4"]
    assert main(baseline_argv(command, tiny_model_dir, tmp_path / "a.json") + argv +
                ["--reward-model", str(rms["gpt2"])]) == 0
    with served(rms["gpt2"], batch_size=4) as server:
        assert main(baseline_argv(command, tiny_model_dir, tmp_path / "b.json") + argv +
                    ["--reward-url", server.url]) == 0
    a, b = (json.loads((tmp_path / f"{x}.json" / "eta1.eval.json" if command == "interpolate"
                        else tmp_path / f"{x}.json").read_text()) for x in "ab")
    if command == "bon":
        assert a == b
        return
    assert a["metrics"] == b["metrics"]
    assert [s["score"] for s in a["samples"]] == [s["score"] for s in b["samples"]]


# ----------------------------------------------------------------------------- refusals

def _grpo(tmp_path, prompts, *reward) -> list[str]:
    return ["grpo", "--policy", str(tmp_path / "policy"), "--prompts", str(prompts),
            "--run-name", "r", "--output-dir", str(tmp_path / "runs"), "--batch-size", "4",
            "--samples-per-prompt", "2", "--device", "cpu", *reward]


@pytest.fixture
def workdir(tmp_path, tiny_model_dir):
    """A policy (a link to the tiny GPT-2) and plain and chat prompt files under one root."""
    (tmp_path / "policy").symlink_to(tiny_model_dir)
    write_jsonl(tmp_path / "plain.jsonl", [{"prompt": p} for p in PLAIN])
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    return tmp_path


@pytest.mark.parametrize("stage", ["grpo", "eval"])
def test_a_dead_endpoint_is_one_line_before_any_model_loads(stage, workdir, capsys, no_loads):
    url = f"http://127.0.0.1:{free_port()}"
    argv = (_grpo(workdir, workdir / "plain.jsonl", "--reward-url", url) if stage == "grpo" else
            ["eval", "--model", str(workdir / "policy"), "--prompts", str(workdir / "plain.jsonl"),
             "--output", str(workdir / "e.json"), "--device", "cpu", "--reward-url", url])
    line = refused(workdir, argv, "", capsys)
    assert line == (f"error: --reward-url {url}: cannot connect (Connection refused); start it "
                    "with tether serve-rm MODEL --port N, or check the address")
    assert no_loads == []


def test_endpoints_serving_different_models_are_refused(rms, workdir, capsys, request):
    with served(rms["gpt2"]) as one, served(rms["llama"]) as two:
        request.getfixturevalue("no_loads")  # the servers are up: from now on nothing loads
        refused(workdir, _grpo(workdir, workdir / "plain.jsonl", "--reward-url",
                               f"{one.url},{two.url}"),
                r"--reward-url endpoints serve different models: .*gpt2 \(served at "
                rf"{one.url}\), float32, and .*llama \(served at {two.url}\), float32 .*serve "
                "one model, in one dtype, at every URL", capsys)


def test_one_model_in_two_dtypes_is_two_models(rms, workdir, capsys):
    with served(rms["gpt2"], dtype="float32") as one, served(rms["gpt2"], dtype="bfloat16") as two:
        refused(workdir, _grpo(workdir, workdir / "plain.jsonl", "--reward-url",
                               f"{one.url},{two.url}"), "float32, and .*bfloat16", capsys)


def test_chat_prompts_need_the_served_models_chat_template(rms, workdir, tiny_llama_dir, capsys,
                                                           request):
    # the policy renders the chats with its template; the served model has none to read them
    argv = _grpo(workdir, workdir / "chat.jsonl")
    argv[argv.index("--policy") + 1] = str(tiny_llama_dir)
    with served(rms["gpt2"]) as server:
        request.getfixturevalue("no_loads")
        refused(workdir, argv + ["--reward-url", server.url],
                r"the prompts are chat messages but the reward model .*gpt2 \(served at "
                rf"{server.url}\) has no chat template to render them with", capsys)


@pytest.mark.parametrize("extra, pattern", [
    (["--reward-url", "http://127.0.0.1:9", "--reward-fn", "m:f"],
     r"give exactly one reward: .*\(got --reward-fn, --reward-url\)"),
    (["--reward-url", "localhost:8000"], r"--reward-url localhost:8000 is not an http:// URL"),
    (["--reward-url", "http://a:1,http://a:1"], "names an endpoint twice"),
    (["--reward-fn", "m:f", "--reward-url-timeout", "5"],
     "--reward-url-timeout applies with --reward-url, and tether grpo runs with no --reward-url"),
])
def test_reward_url_options_are_checked_first(extra, pattern, workdir, capsys, no_loads):
    refused(workdir, _grpo(workdir, workdir / "plain.jsonl", *extra), pattern, capsys)


@pytest.mark.parametrize("case", ["causal-lm", "missing", "port-in-use"])
def test_serve_rm_bad_input_is_one_line(case, rms, tiny_model_dir, tmp_path, capsys):
    model = {"causal-lm": str(tiny_model_dir), "missing": str(tmp_path / "nope")}.get(
        case, str(rms["gpt2"]))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1] if case == "port-in-use" else 0
        line = refused(tmp_path, ["serve-rm", model, "--port", str(port), "--device", "cpu"],
                       {"causal-lm": "is not a reward model", "missing": "nope",
                        "port-in-use": f"cannot listen on 127.0.0.1:{port} .*choose another "
                                       "--port"}[case], capsys)
    assert "Traceback" not in line


# ----------------------------------------------------------------------------- failures

class Stub(ThreadingHTTPServer):
    """A fake endpoint: /info like serve-rm's; /score answers from `plan` in turn (a status
    code, "hang", or "ok" for len(response) as the scores)."""

    daemon_threads = True

    def __init__(self, plan: list, scores=None, info_delay: float = 0.0):
        self.plan, self.posts, self.scores = list(plan), 0, scores
        self.info_delay = info_delay  # seconds before /info answers
        super().__init__(("127.0.0.1", 0), StubHandler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self):
        self.shutdown()
        self.server_close()

    def handle_error(self, request, client_address):  # a client that left: nothing to report
        pass


class StubHandler(BaseHTTPRequestHandler):
    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        time.sleep(self.server.info_delay)
        self._send(200, {"model": "stub", "chat_template": False, "fingerprint": "f" * 16})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        step = server.plan[min(server.posts, len(server.plan) - 1)]
        server.posts += 1
        if step == "hang":
            time.sleep(5)
        if step in ("ok", "hang"):
            self._send(200, {"scores": server.scores or
                             [float(len(r)) for r in body["responses"]]})
        else:
            self._send(step, {"error": "CUDA out of memory"})

    def log_message(self, *args):
        pass


def test_a_500_is_retried_and_then_scores(monkeypatch):
    monkeypatch.setattr(remote_reward, "BACKOFF_S", 0.01)
    stub = Stub([500, 503, "ok"])
    try:
        scores = score_remote(connect([stub.url]), PLAIN, RESPONSES, timeout=10)
    finally:
        stub.close()
    assert scores.tolist() == [float(len(r)) for r in RESPONSES] and stub.posts == 3


def test_a_500_that_stays_is_one_line_naming_the_url(monkeypatch):
    monkeypatch.setattr(remote_reward, "BACKOFF_S", 0.01)
    stub = Stub([500])
    try:
        with pytest.raises(TetherError) as caught:
            score_remote(connect([stub.url]), PLAIN, RESPONSES, timeout=10)
    finally:
        stub.close()
    assert str(caught.value) == (f"--reward-url {stub.url}: the server answered /score with "
                                 "CUDA out of memory after 4 tries; check the server's log")
    assert stub.posts == 4


def test_a_400_is_not_retried(monkeypatch):
    stub = Stub([400])
    try:
        with pytest.raises(TetherError, match=f"^--reward-url {stub.url}: the server answered "
                                              "/score with CUDA out of memory$"):
            score_remote(connect([stub.url]), PLAIN, RESPONSES, timeout=10)
    finally:
        stub.close()
    assert stub.posts == 1


def test_a_401_is_one_line_not_retried(monkeypatch):
    monkeypatch.setattr(remote_reward, "BACKOFF_S", 0.01)
    monkeypatch.delenv("TETHER_RM_API_KEY", raising=False)
    stub = Stub([401])
    try:
        with pytest.raises(TetherError, match=f"^--reward-url {stub.url}: the server wants its "
                                              "API key, and .TETHER_RM_API_KEY is not set; set "
                                              "it to the key the server was started with$"):
            score_remote(connect([stub.url]), PLAIN, RESPONSES, timeout=10)
    finally:
        stub.close()
    assert stub.posts == 1


@pytest.mark.parametrize("stage", ["grpo", "eval", "bon", "interpolate"])
def test_a_hung_endpoint_stops_the_run_with_one_line(stage, workdir, capsys):
    stub = Stub(["hang"])
    try:
        argv = (_grpo(workdir, workdir / "plain.jsonl") if stage == "grpo" else
                baseline_argv(stage, workdir / "policy", workdir / "e.json")
                + ["--prompts", str(workdir / "plain.jsonl"), "--device", "cpu"])
        capsys.readouterr()
        assert main(argv + ["--reward-url", stub.url, "--reward-url-timeout", "0.5",
                            "--max-new-tokens", "4"]) == 2
    finally:
        stub.close()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"error: --reward-url {stub.url}: no answer to /score within 0.5 s "
                     "(--reward-url-timeout); check the server, or raise --reward-url-timeout; "
                     "checkpoints written so far are intact"], err
    assert stub.posts == 1  # a hung server is not asked again


@pytest.mark.parametrize(("score", "said"), [(float("nan"), "nan"), (10**400, "inf"),
                                             (-10**400, "-inf")], ids=["nan", "1e400", "-1e400"])
def test_a_non_finite_score_is_named_not_trained_on(score, said):
    """NaN, and an integer no float holds (JSON `1000...0`, 401 digits: before, torch.tensor's
    OverflowError traceback), which reads as inf: the served model's bad-score line."""
    stub = Stub(["ok"], scores=[0.0, score, 1.0, 2.0])
    try:
        reward = remote_reward.reward_from_urls(connect([stub.url]), {}, timeout=10)
        with pytest.raises(NonFiniteScore, match=r"the reward model stub \(served at .*\) gave "
                                                 rf"response 1 .*a non-finite score \({said}\)"):
            reward(PLAIN, RESPONSES, None, None)
    finally:
        stub.close()


def test_the_info_wait_is_reward_url_timeout(monkeypatch):
    """/info is waited for --reward-url-timeout, the option its line says to raise (before: at
    most a fixed 10 s, whatever the option said)."""
    monkeypatch.setattr(remote_reward, "INFO_TIMEOUT_S", 0.2)  # the fixed wait, shortened
    stub = Stub(["ok"], info_delay=1.0)
    try:
        assert connect([stub.url], timeout=10)[0].info["model"] == "stub"
        with pytest.raises(TetherError, match=r"no answer to /info within 0.5 s "
                                              r"\(--reward-url-timeout\); check the server, or "
                                              r"raise --reward-url-timeout"):
            connect([stub.url], timeout=0.5)
    finally:
        stub.close()
