"""Reward functions: math/exact tables, the remote RM against a real HTTP server, plugins."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlslurm.errors import ConfigError
from rlslurm.rollout.rewards import (
    RemoteRM,
    RewardError,
    RewardInput,
    build_reward_fn,
    exact_reward,
    last_boxed,
    load_reward_fn,
    math_reward,
    score_group,
)

# (response, label, expected reward)
MATH_CASES = [
    # fractions and decimals
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"so \boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\frac{2}{4}}", "1/2", 1.0),
    (r"\boxed{-\frac12}", "-0.5", 1.0),
    (r"\boxed{0.333}", "1/3", 0.0),  # a rounded decimal is not the fraction
    (r"\boxed{\frac{1}{3}}", "1/2", 0.0),
    # boxed extraction: nested braces, last box wins, \fbox, spaces
    (r"first \boxed{3}, on reflection \boxed{4}", "4", 1.0),
    (r"first \boxed{3}, on reflection \boxed{4}", "3", 0.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", 1.0),
    (r"\fbox{7}", "7", 1.0),
    (r"\boxed {12}", "12", 1.0),
    # units, degrees, percent, thousands separators
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{5 \mathrm{cm}}", "5", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{2,000}", "2000", 1.0),
    # LaTeX structures
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{[1, 3)}", "[1,3)", 1.0),
    (r"\boxed{(1, 3]}", "[1,3)", 0.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    (r"\boxed{x = 2}", "2", 1.0),
    (r"\boxed{\pi}", "3.14159", 0.0),
    # no box: the answer in the text
    ("Adding them up, the answer is 42.", "42", 1.0),
    ("Adding them up, the answer is 41.", "42", 0.0),
    # garbage never raises
    (r"garbage }}}{{\boxed{", "1", 0.0),
    ("", "1", 0.0),
    (r"\boxed{\frac{1}{", "1", 0.0),
    ("\x00\x01 \\boxed{\\\\\\}", "1", 0.0),
    (r"\boxed{1}", "", 0.0),
    (r"\boxed{5}", 5, 1.0),  # numeric labels from JSON
]


@pytest.mark.parametrize("response,label,expected", MATH_CASES)
def test_math_reward_table(response, label, expected):
    assert math_reward(response, label) == expected


def test_math_reward_never_raises_on_non_strings():
    assert math_reward(None, "1") == 0.0  # type: ignore[arg-type]
    assert math_reward(r"\boxed{1}", None) == 0.0


def test_math_reward_works_off_the_main_thread():
    # math-verify's own timeout uses signal.alarm, which raises off the main thread
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]


def test_exact_reward_and_boxed_extraction():
    assert exact_reward("  Paris \n", "Paris") == 1.0
    assert exact_reward("paris", "Paris") == 0.0
    assert exact_reward(r"I think \boxed{Paris}", "Paris") == 1.0
    assert exact_reward("a  b", "a b") == 1.0
    assert exact_reward("7", 7) == 1.0
    assert exact_reward("7", None) == 0.0
    assert last_boxed(r"\boxed{a} and \boxed{b") == "a"  # an unbalanced last box falls back
    assert last_boxed("no box") is None


# --------------------------------------------------------------------------- remote RM


class RMServer:
    """A real HTTP reward server: fails the first `fail_first` calls with `fail_status`."""

    def __init__(self, fail_first=0, fail_status=503, delay_s=0.0, reply=None):
        self.calls: list[dict] = []
        self.headers: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.calls.append(body)
                outer.headers.append(dict(self.headers))
                if len(outer.calls) <= fail_first:
                    if delay_s:
                        time.sleep(delay_s)
                    try:
                        self.send_response(fail_status)
                        self.end_headers()
                        self.wfile.write(b"busy")
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client timed out and hung up, as the timeout test wants
                    return
                correct = body["response"] == body["label"]
                reply_obj = reply if reply is not None else {"reward": 1.0 if correct else 0.0}
                data = json.dumps(reply_obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def rm_server(request):
    servers = []

    def make(**kw):
        s = RMServer(**kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def item(response, label="yes", where="d.jsonl:1"):
    return RewardInput(prompt="q", response=response, label=label, metadata={"m": 1}, where=where)


def test_remote_rm_scores_and_sends_api_key(rm_server):
    srv = rm_server()
    rm = RemoteRM(srv.url, timeout=5, retries=0, api_key="sekret")

    async def go():
        try:
            return await score_group([item("yes"), item("no")], build_reward_fn("remote", rm_url=srv.url))
        finally:
            await rm.aclose()

    assert asyncio.run(go()) == [1.0, 0.0]
    # score_group scores a group's samples concurrently: the server sees them in either order.
    by_response = {c["response"]: c for c in srv.calls}
    assert len(srv.calls) == 2 and set(by_response) == {"yes", "no"}
    assert by_response["yes"] == {"prompt": "q", "response": "yes", "label": "yes", "metadata": {"m": 1}}

    async def with_key():
        try:
            return await rm(item("yes"))
        finally:
            await rm.aclose()

    assert asyncio.run(with_key()) == 1.0
    assert srv.headers[-1]["Authorization"] == "Bearer sekret"


def test_remote_rm_retries_5xx_then_succeeds(rm_server):
    srv = rm_server(fail_first=2, fail_status=503)
    rm = RemoteRM(srv.url, timeout=5, retries=2, backoff_s=0.01)
    assert asyncio.run(rm(item("yes"))) == 1.0
    assert len(srv.calls) == 3


def test_remote_rm_gives_up_after_retries_and_on_4xx(rm_server):
    srv = rm_server(fail_first=10, fail_status=500)
    with pytest.raises(RewardError, match=r"--rm-url .*failed after 3 attempts; last error: HTTP 500"):
        asyncio.run(RemoteRM(srv.url, retries=2, backoff_s=0.01)(item("yes")))
    assert len(srv.calls) == 3
    bad = rm_server(fail_first=10, fail_status=400)
    with pytest.raises(RewardError, match="HTTP 400 \\(not retried\\)"):
        asyncio.run(RemoteRM(bad.url, retries=5, backoff_s=0.01)(item("yes")))
    assert len(bad.calls) == 1


def test_remote_rm_timeout_is_retried(rm_server):
    srv = rm_server(fail_first=1, delay_s=30.0)  # first call hangs far past the timeout
    rm = RemoteRM(srv.url, timeout=0.3, retries=1, backoff_s=0.01)
    t0 = time.monotonic()
    assert asyncio.run(rm(item("yes"))) == 1.0
    assert time.monotonic() - t0 < 10  # did not wait for the slow reply (30 s); no tight margin on a loaded host


def test_remote_rm_dict_rewards_and_bad_replies(rm_server):
    srv = rm_server(reply={"acc": 1, "fmt": 0.5})
    fn = build_reward_fn("remote", rm_url=srv.url)
    assert asyncio.run(score_group([item("x")], fn, reward_key="acc")) == [{"acc": 1.0, "fmt": 0.5}]
    with pytest.raises(RewardError, match=r"returned a dict \['acc', 'fmt'\]; set --reward-key"):
        asyncio.run(score_group([item("x")], fn))
    junk = rm_server(reply=["nope"])
    with pytest.raises(RewardError, match="expected a number"):
        asyncio.run(RemoteRM(junk.url, retries=0)(item("x")))


def test_remote_rm_flag_checks():
    with pytest.raises(ConfigError, match="--rm-type remote needs --rm-url"):
        build_reward_fn("remote")
    with pytest.raises(ConfigError, match="--rm-url 'localhost:1'"):
        RemoteRM("localhost:1")
    with pytest.raises(ConfigError, match="--rm-type 'nope'"):
        build_reward_fn("nope")


# --------------------------------------------------------------------------- plugins


PLUGIN = '''
import asyncio
from rlslurm.rollout.rewards import group_reward, math_reward

def length_penalty(item):
    return math_reward(item.response, item.label) - 0.01 * len(item.response)

async def async_judge(item):
    await asyncio.sleep(0)
    return {"acc": float(item.response == item.label), "len": float(len(item.response))}

@group_reward
def rank_in_group(items):
    # best (shortest correct) answer gets 1, the rest 0: needs the whole group
    scores = [len(i.response) if i.response == i.label else 1e9 for i in items]
    best = min(range(len(items)), key=scores.__getitem__)
    return [1.0 if k == best else 0.0 for k in range(len(items))]

def wrong_count(items):
    return [1.0]

def returns_text(item):
    return "high"

def explodes(item):
    raise KeyError("score")

def nan(item):
    return float("nan")

not_callable = 3

def numpy_scores(item):
    import numpy as np
    return np.float32(np.mean([1.0, 0.5]))

def numpy_dict(item):
    import numpy as np
    return {"acc": np.bool_(item.response == item.label), "len": np.int64(len(item.response)), "p": np.array(0.25)}

def plain_bool(item):
    return item.response == item.label

def numpy_nan(item):
    import numpy as np
    return np.float64("nan")

def numpy_vector(item):
    import numpy as np
    return np.array([1.0, 2.0])
'''


@pytest.fixture
def plugin_path(tmp_path):
    p = tmp_path / "my_rm.py"
    p.write_text(PLUGIN)
    return p


def test_custom_per_sample_sync_and_async(plugin_path):
    fn = load_reward_fn(f"{plugin_path}:length_penalty")
    assert not fn.group
    r = asyncio.run(score_group([item(r"\boxed{2}", "2"), item("x", "2")], fn))
    assert r == [pytest.approx(1.0 - 0.09), pytest.approx(-0.01)]
    fn = load_reward_fn(f"{plugin_path}:async_judge")
    assert asyncio.run(score_group([item("yes")], fn, reward_key="acc")) == [{"acc": 1.0, "len": 3.0}]


def test_numpy_and_bool_rewards_score_as_floats(plugin_path):
    """Reward code often computes with numpy (np.float32 from a mean) or returns `answer == label`."""
    fn = load_reward_fn(f"{plugin_path}:numpy_scores")
    [r] = asyncio.run(score_group([item("a")], fn))
    assert r == 0.75 and type(r) is float
    fn = load_reward_fn(f"{plugin_path}:numpy_dict")
    [r] = asyncio.run(score_group([item("yes")], fn, reward_key="acc"))
    assert r == {"acc": 1.0, "len": 3.0, "p": 0.25} and all(type(v) is float for v in r.values())
    fn = load_reward_fn(f"{plugin_path}:plain_bool")
    assert asyncio.run(score_group([item("yes"), item("no")], fn)) == [1.0, 0.0]
    with pytest.raises(RewardError, match=r"numpy_nan \(sample d.jsonl:1\): returned nan"):
        asyncio.run(score_group([item("a")], load_reward_fn(f"{plugin_path}:numpy_nan")))
    with pytest.raises(RewardError, match=r"numpy_vector .*returned ndarray"):
        asyncio.run(score_group([item("a")], load_reward_fn(f"{plugin_path}:numpy_vector")))


def test_custom_per_group(plugin_path):
    fn = load_reward_fn(f"{plugin_path}:rank_in_group")
    assert fn.group  # from the decorator
    group = [item("yes!"), item("yes"), item("no")]
    group[0].label = "yes!"
    assert asyncio.run(score_group(group, fn)) == [0.0, 1.0, 0.0]
    # --group-rm forces group mode on an undecorated function, and its length is checked
    fn = load_reward_fn(f"{plugin_path}:wrong_count", group=True)
    with pytest.raises(RewardError, match=r"one reward per sample \(2\), got 1 rewards"):
        asyncio.run(score_group([item("a"), item("b")], fn))


@pytest.mark.parametrize(
    "name,pattern",
    [
        ("returns_text", r"returns_text \(sample d.jsonl:1\): returned str 'high'"),
        ("explodes", r"explodes: raised KeyError: 'score' \(prompt d.jsonl:1\)"),
        ("nan", r"nan \(sample d.jsonl:1\): returned nan"),
    ],
)
def test_custom_reward_errors_name_the_plugin(plugin_path, name, pattern):
    fn = load_reward_fn(f"{plugin_path}:{name}")
    with pytest.raises(RewardError, match=pattern):
        asyncio.run(score_group([item("a")], fn))


def test_bad_custom_rm_specs(plugin_path, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"--custom-rm-path .*not_callable.*int object is not callable"):
        load_reward_fn(f"{plugin_path}:not_callable")
    with pytest.raises(ConfigError, match=r"--custom-rm-path .*has no attribute 'missing'"):
        load_reward_fn(f"{plugin_path}:missing")
    with pytest.raises(ConfigError, match=r"--custom-rm-path .*does not exist"):
        load_reward_fn(f"{tmp_path}/nope.py:f")
    with pytest.raises(ConfigError, match=r"--custom-rm-path 'no_such_mod_xyz:f': no module named 'no_such_mod_xyz'"):
        load_reward_fn("no_such_mod_xyz:f")
    with pytest.raises(ConfigError, match=r"--custom-rm-path 'justaname': expected"):
        load_reward_fn("justaname")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_abc\n")
    with pytest.raises(ConfigError, match=r"importing .*broken.py failed: ModuleNotFoundError"):
        load_reward_fn(f"{broken}:f")
    # importable modules work too, and a wrong arity is caught at load time
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("my_rm:length_penalty").fn.__name__ == "length_penalty"
    with pytest.raises(ConfigError, match="cannot be called with 1 positional"):
        load_reward_fn("rlslurm.rollout.rewards:exact_reward")  # (response, label): not a per-sample fn


def test_builtin_reward_dispatch():
    fn = build_reward_fn("math")
    assert asyncio.run(score_group([item(r"\boxed{0.5}", "1/2"), item("nope", "1/2")], fn)) == [1.0, 0.0]
    fn = build_reward_fn("exact")
    assert asyncio.run(score_group([item("yes"), item("no")], fn)) == [1.0, 0.0]


def test_metadata_can_pick_the_rule_per_record():
    fn = build_reward_fn("math")
    items = [RewardInput("q", r"\boxed{0.5}", "1/2"), RewardInput("q", r"\boxed{0.5}", "1/2", {"rm_type": "exact"}),
             RewardInput("q", "Paris", "Paris", {"rm_type": "exact"})]
    assert asyncio.run(score_group(items, fn)) == [1.0, 0.0, 1.0]
    bad = RewardInput("q", "x", "y", {"rm_type": "llm_judge"}, where="d.jsonl:9")
    with pytest.raises(RewardError, match=r"d.jsonl:9: metadata rm_type 'llm_judge' is not one of"):
        asyncio.run(score_group([bad], fn))


def test_rewards_in_a_process_pool_match_inline():
    from rlslurm.rollout.rewards import reward_executor

    items = [RewardInput("q", resp, label, where=f"d.jsonl:{i}") for i, (resp, label, _) in enumerate(MATH_CASES)]
    expected = [e for _, _, e in MATH_CASES]
    fn = build_reward_fn("math")
    with reward_executor(2) as pool:
        assert asyncio.run(score_group(items, fn, executor=pool)) == expected
        bad = RewardInput("q", "x", "y", {"rm_type": "nope"}, where="d.jsonl:3")
        with pytest.raises(RewardError, match="d.jsonl:3: metadata rm_type 'nope'"):
            asyncio.run(score_group([bad], fn, executor=pool))


def test_remote_rm_bounds_name_no_phantom_flags() -> None:
    """timeout and retries are RemoteRM's arguments, not flags: the errors must not send a user looking
    for --rm-timeout or --rm-retries (issue 33)."""
    for kwargs, what in (({"retries": -1}, "retries"), ({"timeout": 0}, "timeout")):
        with pytest.raises(ConfigError, match=f"^RemoteRM: {what} must be") as e:
            RemoteRM("http://127.0.0.1:1", **kwargs)
        assert "--rm-" not in str(e.value)
