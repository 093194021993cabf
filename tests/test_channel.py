"""The pipe channels between the API process and the engine core: order, non-blocking puts, flush, a gone peer."""
from __future__ import annotations

import queue
import threading

import pytest

from llmrt.engine.channel import channel


def test_messages_arrive_in_put_order_from_several_threads_each():
    reader, writer = channel(background=True)
    def put_range(tag: str) -> None:
        for i in range(300):
            writer.put((tag, i))
    threads = [threading.Thread(target=put_range, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    got = {"a": [], "b": []}
    for _ in range(600):
        tag, i = reader.get(timeout=5)
        got[tag].append(i)
    for t in threads:
        t.join()
    assert got == {"a": list(range(300)), "b": list(range(300))}
    with pytest.raises(queue.Empty):
        reader.get_nowait()


def test_a_background_put_does_not_block_on_a_full_pipe_and_flush_sends_it_all():
    reader, writer = channel(background=True)
    big = b"x" * (1 << 20)  # far beyond a pipe's buffer: a direct send would block until read
    done = threading.Event()
    threading.Thread(target=lambda: (writer.put(big), writer.put("end"), done.set()), daemon=True).start()
    assert done.wait(5), "put blocked on the pipe"
    assert reader.get(timeout=5) == big and reader.get(timeout=5) == "end"
    writer.put("last")
    writer.flush()
    assert reader.get(timeout=0) == "last"  # in the pipe already once flush returns


def test_small_puts_into_a_pipe_with_room_skip_the_feeder_and_keep_order_when_it_fills():
    reader, writer = channel(background=True)
    writer.put("small")
    assert writer._feeder is None  # written at once: no thread woken for it
    assert reader.get(timeout=0) == "small"
    # Unread, the pipe fills: later puts go through the feeder, and a small one after them must not overtake them.
    msgs = [bytes([i]) * 20000 for i in range(8)] + ["tail"]
    for m in msgs:
        writer.put(m)
    assert writer._feeder is not None
    assert [reader.get(timeout=5) for _ in msgs] == msgs


def test_read_ready_never_waits_on_a_half_written_message_and_reads_eof_after_the_rest():
    import os
    import time
    from multiprocessing.reduction import ForkingPickler

    reader, writer = channel()
    assert reader.read_ready() == []  # nothing there: no wait
    writer.put("one")
    writer.put({"two": [2] * 5000})  # over 16 KiB pickled: send_bytes writes length and body separately
    got = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += reader.read_ready()
    assert got == ["one", {"two": [2] * 5000}]
    # A writer stopped halfway through a message: the whole frame is not there, so nothing is returned yet.
    body = bytes(ForkingPickler.dumps("three"))
    frame = len(body).to_bytes(4, "big") + body
    fd = writer._conn.fileno()
    os.write(fd, frame[:6])
    assert reader.read_ready() == []
    os.write(fd, frame[6:])
    writer.put("four")
    got = []
    while len(got) < 2 and time.monotonic() < deadline:
        got += reader.read_ready()
    assert got == ["three", "four"]
    # A message that cannot be unpickled is dropped (and logged); the next one still arrives.
    os.write(fd, (4).to_bytes(4, "big") + b"junk")
    writer.put("five")
    got = []
    while not got and time.monotonic() < deadline:
        got += reader.read_ready()
    assert got == ["five"]
    writer.close()
    with pytest.raises(EOFError):
        reader.read_ready()


def test_a_gone_reader_drops_sends_and_a_gone_writer_reads_as_eof():
    reader, writer = channel()
    reader.close()
    writer.put("nobody listens")  # no exception: the other side notices the death on its own
    reader, writer = channel()
    writer.close()
    with pytest.raises(EOFError):
        reader.get(timeout=1)


def test_a_writer_pickles_without_its_threads():
    _, writer = channel(background=True)
    writer.put("started the feeder")
    state = writer.__getstate__()
    assert set(state) == {"conn", "background"}  # what a spawned child gets; it starts its own feeder
