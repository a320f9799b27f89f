"""The reward settings' checks that need neither a model nor the user's code, so that they come
before torch loads (issue 47): the CLI's preflight (`tether.cli.preflight`) runs them on what
flags and files name, and `tether.rl.reward.wiring.user_code` again with what a Python caller
passed besides (a `reward_fn`, a `gold_fn`, an environment factory: a config's `validate()`
cannot know of them, so it leaves these checks to the two). The checks that need the model's config (the
reward model's kind, the lengths against its positions, the vocabularies) come after, before any
weights load (docs/errors.md)."""

from __future__ import annotations

import urllib.parse

from tether.errors import TetherError
from tether.run.user_code.calls import MAX_RETRY_DELAY_S

MAX_WORKERS = 1024  # more concurrent calls than any endpoint or machine serves
# up to 10 s apart: 100 retries wait out a quarter of an hour's outage (1,000,000 overflowed the
# backoff's 2 ** attempt into a traceback)
MAX_RETRIES = 100


def check_rewards(cfg, *, training: bool, reward_fn: bool = False, gold_fn: bool = False,
                  env: bool = False) -> None:
    """Which reward (exactly one for training, at most one proxy for an evaluation; an
    environment rewards its own episodes), --reward-url's form, --reward-weights, and the pool's and the timeout's
    settings against the functions there are. `cfg`: a config with the reward and environment
    sections; `reward_fn`, `gold_fn`, `env`: given from Python."""
    given = {"a Python reward_fn": reward_fn, "--reward-fn": bool(cfg.reward_fn),
             "--reward-model": bool(cfg.reward_model), "--reward-url": bool(cfg.reward_url)}
    proxies = [name for name, on in given.items() if on]
    functions = reward_fn or bool(cfg.reward_fn)
    if env or cfg.env:
        check_episode_reward(cfg, bool(proxies), env_given=True)
    else:
        check_episode_reward(cfg, functions, env_given=False)
        # a teacher's KL alone is an objective (on-policy distillation): its reward is optional
        if len(proxies) > 1 or training and not proxies and not getattr(cfg, "teacher", ""):
            raise TetherError(f"give {'exactly one reward' if training else 'at most one proxy reward'}"
                              ": --reward-model, --reward-url, --reward-fn or a Python "
                              f"reward_fn (got {', '.join(proxies) if proxies else 'none'})")
    if getattr(cfg, "reward_weights", ()) and not functions:
        raise TetherError("--reward-weights weighs reward functions; give them with --reward-fn "
                          "or drop --reward-weights")
    if cfg.reward_url:
        parse_urls(cfg.reward_url)  # the URLs' form; they answer in wiring.remote
    scored = functions or gold_fn or bool(cfg.gold_fn)
    # --reward-fn-timeout times the reward and gold functions: a value other than the default
    # with neither is an option that would be accepted and ignored
    if cfg.reward_fn_timeout != type(cfg).reward_fn_timeout and not scored:
        raise TetherError(f"--reward-fn-timeout {cfg.reward_fn_timeout:g} limits the calls of "
                          "--reward-fn and --gold-fn functions, and this run has none; drop it "
                          "(an environment's calls have --env-timeout)")
    check_reward_pool(cfg, scored)


def check_episode_reward(settings, reward_given: bool, env_given: bool) -> None:
    """One reward per episode: an environment's own, or --tools' --reward-fn on the final answer
    (`reward_given`, `env_given`: a reward or an environment was named, by flag or from
    Python)."""
    if env_given and reward_given:
        raise TetherError("an environment rewards its own episodes; drop --reward-fn, "
                          "--reward-model and --reward-url (or score inside the environment's "
                          "step)")
    if settings.tools and (getattr(settings, "reward_model", "")
                           or getattr(settings, "reward_url", "") or not reward_given):
        raise TetherError("--tools episodes are scored by --reward-fn on the final answer; "
                          "give a reward function (docs/agents.md)")


def check_reward_pool(cfg, has_functions: bool) -> None:
    """--reward-workers and --reward-retries: in range, and only where they act (Python reward
    or gold functions scoring a batch's responses), never accepted and ignored."""
    workers, retries = cfg.reward_workers, cfg.reward_retries
    if not 0 <= workers <= MAX_WORKERS:
        raise TetherError(f"--reward-workers {workers} must lie in [0, {MAX_WORKERS}] (0 or 1: "
                          "one call per batch; N > 1: N rows scored at a time)")
    if not 0 <= retries <= MAX_RETRIES:
        raise TetherError(f"--reward-retries {retries} must lie in [0, {MAX_RETRIES}] (0: a "
                          f"failed call is not tried again; each retry waits up to "
                          f"{MAX_RETRY_DELAY_S:g} s)")
    if workers > 1 and cfg.episodic:
        raise TetherError(f"--reward-workers {workers} scores a batch's responses in parallel; "
                          "an episode's reward is scored inside its environment's step, which "
                          "--env-workers already runs concurrently; drop it")
    if workers > 1 and not has_functions:
        raise TetherError(f"--reward-workers {workers} scores the rows of --reward-fn and "
                          "--gold-fn functions in parallel, and this run has none; drop it (a "
                          "reward model scores a batch in one forward)")
    if retries != type(cfg).reward_retries and workers <= 1:
        raise TetherError(f"--reward-retries {retries} retries calls of the reward pool, and "
                          "there is none; pass --reward-workers N (N > 1) or drop it")


def parse_urls(spec: str) -> list[str]:
    """`--reward-url URL[,URL...]` as a list of `http://host:port` (a trailing slash dropped);
    anything but an http(s) URL with a host, or a URL given twice, is one line."""
    urls = [u.strip().rstrip("/") for u in spec.split(",")]
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise TetherError(f"--reward-url {url or spec} is not an http:// URL; give "
                              "http://HOST:PORT of a tether serve-rm (several joined by commas)")
    if len(set(urls)) != len(urls):
        raise TetherError(f"--reward-url {spec} names an endpoint twice; give each once")
    return urls
