"""A fake `ray` module: the part of Ray that router/launch/ray.py, router/pools/ray_pool.py and
router/deploy/ray_router.py use, in process (tests/deploy/test_ray.py runs the real cluster)."""
from __future__ import annotations

import types


class RayError(Exception):
    actor_init_failed = False


class ActorInitError(RayError):
    """What Ray raises for a call to an actor whose constructor raised: it is not restarted."""

    actor_init_failed = True


class Ref:
    """A call's result: ready with a value or an error, or never answered (`pending`)."""

    def __init__(self, value=None, error: Exception | None = None, pending: bool = False) -> None:
        self.value, self.error, self.pending = value, error, pending


class FakeActor:
    """A named actor: a worker's (`spec`: its spec as a dict) or the router's (`spec`: its
    DeploymentConfig). `info_error`: what its `info` call raises."""

    def __init__(self, ray: "FakeRay", name: str, namespace: str, options: dict, args: tuple) -> None:
        self.ray, self.name, self.namespace, self.options, self.spec = ray, name, namespace, options, args[0]
        self.code: int | None = None  # the worker's exit code once it exited
        self.answers = True
        self.stopping = False
        self.info_error: Exception | None = None
        self.exit_code = types.SimpleNamespace(remote=self._exit_code)
        self.stop = types.SimpleNamespace(remote=self._stop)
        self.info = types.SimpleNamespace(remote=self._info)
        self.asked = 0

    def _exit_code(self) -> Ref:
        self.asked += 1
        return Ref(self.code) if self.answers else Ref(pending=True)

    def _stop(self, timeout: float) -> Ref:
        self.stopping = True
        self.code = 0 if self.code is None else self.code
        return Ref(self.code)

    def _info(self) -> Ref:
        if self.info_error is not None:
            return Ref(error=self.info_error)
        return Ref({"worker_id": self.name, "role": self.spec["worker"]["role"], "stopping": self.stopping,
                    "address": f"tcp://127.0.0.1:{7000 + len(self.name)}"})


class FakeRay:
    """The part of `ray` that RayLauncher and RayPool use."""

    def __init__(self) -> None:
        self.actors: dict[str, FakeActor] = {}  # by name (one namespace at a time holds a name here)
        self.kills: list[tuple[str, bool]] = []
        self.tasks: list[tuple[str, dict, tuple]] = []  # the remote functions run: name, options, args
        self.task_result: object = None  # what every remote function returns
        self.exceptions = types.SimpleNamespace(RayError=RayError, GetTimeoutError=RayError, RayActorError=RayError)
        self.util = types.SimpleNamespace(
            get_node_ip_address=lambda: "127.0.0.1", list_named_actors=self._list_named_actors,
            scheduling_strategies=types.SimpleNamespace(NodeAffinitySchedulingStrategy=lambda node_id, soft: (
                "node", node_id, soft)))
        self.shutdowns = 0

    def remote(self, cls):
        ray = self
        if not isinstance(cls, type):  # a remote function
            def run(**options):
                def remote(*args):
                    ray.tasks.append((cls.__name__, options, args))
                    return Ref(ray.task_result)
                return types.SimpleNamespace(remote=remote)
            return types.SimpleNamespace(options=run)

        class ActorClass:
            @staticmethod
            def options(name: str, namespace: str, **options):
                def remote(*args):
                    if name in ray.actors:
                        raise ValueError(f"actor name {name!r} is taken")
                    ray.actors[name] = FakeActor(ray, name, namespace, options, args)
                    return ray.actors[name]
                return types.SimpleNamespace(remote=remote)
        return ActorClass

    def _list_named_actors(self, all_namespaces: bool = False) -> list:
        assert all_namespaces
        return [{"name": a.name, "namespace": a.namespace} for a in self.actors.values()]

    def shutdown(self) -> None:
        self.shutdowns += 1

    def wait(self, refs, num_returns, timeout):
        return [r for r in refs if not r.pending], [r for r in refs if r.pending]

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, actor: FakeActor, no_restart: bool) -> None:
        self.kills.append((actor.name, no_restart))
        if no_restart:
            del self.actors[actor.name]
        else:
            actor.code = None  # restarted: a new worker

    def get_actor(self, name: str, namespace: str) -> FakeActor:
        if name not in self.actors or self.actors[name].namespace != namespace:
            raise ValueError(f"no actor {name} in namespace {namespace}")
        return self.actors[name]


class FakeControl:
    """The part of router/pools/control.py's ControlPlane that RayPool reports to."""

    def __init__(self) -> None:
        self.letting_go: set[str] = set()
        self.exits: list[tuple[str, int | None]] = []
        self.joined: set[str] = set()
        self.failed: list[tuple[str, str, str]] = []

    def registered(self, worker_id: str) -> bool:
        return worker_id in self.joined

    def worker_failed(self, worker_id: str, role: str, why: str) -> None:
        self.failed.append((worker_id, role, why))

    def leaving(self, worker_id: str) -> bool:
        return worker_id in self.letting_go

    def worker_exited(self, worker_id: str, code: int | None) -> bool:
        self.exits.append((worker_id, code))
        return True
