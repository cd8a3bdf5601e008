"""`take_ready`: a step hands back everything finished at once, and waits only when asked to."""

import queue
import threading
import time

from batchvl.utils.queues import take_ready


def test_it_takes_everything_the_queue_holds_without_waiting():
    source = queue.SimpleQueue()
    for item in range(3):
        source.put(item)
    started = time.monotonic()
    assert take_ready(source, 0) == [0, 1, 2]
    assert take_ready(source, 0) == []
    assert time.monotonic() - started < 0.5


def test_it_waits_for_a_first_item_only_up_to_its_wait():
    source = queue.Queue()
    threading.Timer(0.05, source.put, args=("late",)).start()
    assert take_ready(source, 5.0) == ["late"]
    started = time.monotonic()
    assert take_ready(source, 0.1) == []
    assert 0.05 < time.monotonic() - started < 2.0
