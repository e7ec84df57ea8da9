"""PyFlink's `thread` execution mode (PEMJA) beside a busy Python thread, by hand (issue 23):

    python -m tests.experiments.thread_mode process 20000
    PYTHONPATH=.venv/lib/python3.11/site-packages python -m tests.experiments.thread_mode thread 20000

(PEMJA's embedded interpreter does not see the venv: hence PYTHONPATH.) A keyed process function
hands each element to an asyncio loop on a thread of its own, as llmstream's stage does, without
waiting for it; the loop thread does Python work between awaits, as the stage's HTTP client does.
Every 1/5 of the input it prints how many elements are done. Results: docs/performance.md
("PyFlink's thread mode").
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any

from pyflink.common import Configuration, Types
from pyflink.datastream import KeyedProcessFunction, StreamExecutionEnvironment


class Stage(KeyedProcessFunction):
    def __init__(self, mode: str, n: int) -> None:
        self.mode, self.n = mode, n

    def open(self, runtime_context: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.done = 0
        self.work = 0
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def busy() -> None:
            while True:
                for _ in range(2000):
                    self.work += 1  # Python work: holds the GIL between switches
                await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(busy(), self.loop)
        self.started = time.monotonic()

    def process_element(self, value: int, ctx: Any) -> Any:
        async def call() -> None:
            await asyncio.sleep(0.001)

        asyncio.run_coroutine_threadsafe(call(), self.loop)  # not waited for
        if self.done % 50 == 0:
            ctx.timer_service().register_processing_time_timer(ctx.timer_service().current_processing_time() + 5)
        self.done += 1
        if self.done % (self.n // 5) == 0:
            print(f"[{self.mode}] {self.done} done, {time.monotonic() - self.started:.1f} s", flush=True)
        yield value

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        yield -1


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    conf = Configuration()
    conf.set_string("python.execution-mode", mode)
    conf.set_string("python.executable", sys.executable)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(1)
    (env.from_collection(list(range(n)), type_info=Types.INT())
        .key_by(lambda x: x % 4, key_type=Types.INT())
        .process(Stage(mode, n), output_type=Types.INT())
        .map(lambda x: x, output_type=Types.INT()))
    started = time.monotonic()
    env.execute("thread-mode-probe")
    print(f"[{mode}] job finished in {time.monotonic() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
