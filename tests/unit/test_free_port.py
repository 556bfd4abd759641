"""free_port: a bindable loopback port outside the kernel's ephemeral range, which outgoing connections draw from."""

import socket

from llmserve import processes


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    low = processes._ephemeral_low()
    for _ in range(20):
        port = processes.free_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


def test_a_port_in_use_is_not_handed_out():
    taken = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", processes.free_port()))
            s.listen()
            taken.append(s)
        assert len({s.getsockname()[1] for s in taken}) == 50
    finally:
        for s in taken:
            s.close()
