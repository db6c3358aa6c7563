"""jaxpg.runtime.service_client's pieces, without starting a coordination service: reading the
service's registration answer, waiting for a listener, the lobby, the long-wait reminder.
(Joining a service, and failing to, runs in tests/multiprocess/test_startup_mp.py.)"""

from __future__ import annotations

import os
import socket
import time

import pytest

from jaxpg.runtime import service_client

# What JAX's client logged when the service gave up on the registration: jax 0.12.0.1's
# wording; 0.10.2 writes the same lines; older releases named tasks by their full path.
BARRIER_LOG = """I1125 10:00:15.624587    6383 coordination_service_agent.cc:169] Coordination \
service agent failed to register with the leader (attempt #1, ...). Error status: \
DEADLINE_EXCEEDED: Barrier timed out. Id: [Init]Wait_for_all_tasks_to_register::0. This \
usually happens because a task triggered the barrier too early or too slowly.
# of tasks that reached the barrier: 1/3.
The first task at the barrier: 0. Some timed out task names:
2
1
 [type.googleapis.com/tensorflow.CoordinationServiceError='']
"""
OLD_NAMES = BARRIER_LOG.replace("\n2\n1\n", "\n/job:jax_worker/replica:0/task:2\n"
                                            "/job:jax_worker/replica:0/task:1\n")


@pytest.mark.parametrize("log", [BARRIER_LOG, OLD_NAMES])
def test_the_services_answer_names_the_missing_ranks(log):
    assert service_client._registration_facts(log) == (1, 3, [1, 2])
    text = service_client._timeout_error("h:1", 0, 3, 10.0, "rank 0", log, None)
    assert text.startswith("init_process_group: 1 of 3 processes joined within 10.0 s; ranks "
                           "that never joined: [1, 2] (this is rank 0 of 3;")


def test_without_the_services_answer_a_lobby_names_them_or_the_error_says_it_cannot():
    plain = "E1125 ... Error status: DEADLINE_EXCEEDED: Deadline Exceeded\n"
    named = service_client._timeout_error("h:1", 2, 4, 5.0, "jaxpg-run", plain, lambda: [0])
    assert "2 of 4 processes joined" in named and "ranks that never joined: [1, 3]" in named
    unknown = service_client._timeout_error("h:1", 2, 4, 5.0, "jaxpg-run", plain, None)
    assert "which ranks are missing is not known here" in unknown
    assert service_client._status(plain) == "DEADLINE_EXCEEDED: Deadline Exceeded"


def test_wait_until_listening_sees_a_listener_and_gives_up_on_none():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert service_client.wait_until_listening(address, time.monotonic() + 5)
    assert not service_client.wait_until_listening(address, time.monotonic() + 0.3)


def test_jaxpg_runs_lobby_lists_who_arrived(tmp_path, monkeypatch):
    monkeypatch.delenv(service_client.LOBBY_VAR, raising=False)
    service_client.note_arrival(3)  # no lobby: nothing happens
    assert service_client.lobby_arrivals() is None
    monkeypatch.setenv(service_client.LOBBY_VAR, str(tmp_path))
    service_client.note_arrival(0)
    service_client.note_arrival(2)
    assert service_client.lobby_arrivals() == {0, 2}


def test_a_long_wait_is_announced_on_stderr(monkeypatch, capfd):
    monkeypatch.setattr(service_client, "REMIND_AFTER_S", 0.05)
    monkeypatch.setattr(service_client, "REMIND_EVERY_S", 600.0)
    reminder = service_client._Reminder(
        service_client._waiting_text("h:1", 0, 2, 1800.0, lambda: [0]))
    err, deadline = "", time.monotonic() + 60
    while "still waiting" not in err and time.monotonic() < deadline:  # until it is written
        time.sleep(0.01)
        err += capfd.readouterr().err
    reminder.stop()
    err += capfd.readouterr().err
    assert err.count("[jaxpg] init_process_group (rank 0 of 2): still waiting after") == 1
    assert "not arrived yet: ranks [1]" in err and "(1800 s)" in err


def test_captured_stderr_keeps_cpp_logs_out_and_passes_other_text(capfd, monkeypatch):
    monkeypatch.delenv("JAXPG_DEBUG", raising=False)
    with service_client._CapturedStderr() as captured:
        os.write(2, b"I1125 10:00:00.000001 1 a.cc:1] noise\n")
    with service_client._CapturedStderr():
        os.write(2, b"a user's own line\n")
    err = capfd.readouterr().err
    assert "noise" not in err and "a user's own line" in err
    assert b"noise" in captured.text
