"""The user's code: the reward and gold functions, environment factories and their methods, and
tools, loaded by name and called under a deadline, one home for every caller.

    load      `module:function` and `file.py:function` loaded (the current directory first on
              the import path), and named in error lines: `function_name`, `raised`
    deadline  `Deadline`: past it, one line and exit 2 (a watchdog thread; the call itself runs
              on the caller's thread, so SIGALRM-using code works on the main thread)
    loop      the process's one event loop for the user's coroutines, on a daemon thread
              (`run_coroutine`), and a sync call in a daemon thread awaited on it
    calls     `Runner`: N calls at a time, each with a timeout and retries, results in the calls'
              order, with the guard against an `async def` function that blocks the loop

Its callers: the reward functions and the reward pool (tether.rl.reward), a served reward
model's posts (tether.rl.reward.remote), an environment's calls (tether.rl.env.calls) and the
tool calls (tether.rl.env.tools).
"""
