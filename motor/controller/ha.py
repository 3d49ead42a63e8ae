"""Leader election of the controllers on etcd (``controller.etcd``).

Every controller runs :class:`Leadership`:

* **follower**: reads ``P/leader``; while a leader holds it, watches the key (a watch from the
  key's revision, renewed every TTL) and publishes the leader's URL so the HTTP API can
  redirect; when the key is gone, campaigns.
* **campaign**: grants a lease of ``lease_ttl_s`` and creates ``P/leader`` on it in one
  transaction that succeeds only if the key does not exist; the key's create revision is the
  fencing token of every later write (:func:`motor.controller.etcd_store.fenced_write`).
* **leader**: ``on_elected`` (the server loads the registry from etcd) then keeps the lease
  alive every TTL / 3. It stops acting as leader -- ``on_deposed`` -- when etcd says the lease
  expired, when a fenced write fails, or when it could not renew the lease for the TTL (minus a
  0.25 s margin) by its own clock: a leader cut off from etcd steps down before etcd gives the
  key to another, so no two leaders write (and a deposed one's writes fail anyway).

With etcd fully down no controller leads: node managers keep their engines running and retry,
coordinators keep routing on their last table (static stability, docs/control-plane.md).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable

from motor.config.schema import EtcdConfig
from motor.controller.etcd_store import (EtcdSession, EtcdUnavailable, Lease, campaign,
                                         read_leader, retrieve_outcome)

logger = logging.getLogger(__name__)

#: how long :meth:`Leadership.stop` waits for the cancelled election task (seconds)
STOP_WAIT_S = 2.0


class Leadership:
    """The election loop of one controller.

    Parameters
    ----------
    config : EtcdConfig
    url : str
        This controller's advertised URL (published in ``P/leader``).
    on_elected : async callable
        Awaited once elected, before the controller acts as leader; raising steps down.
    on_deposed : callable(reason: str)
        Called when leadership ends (the server drops its registry).
    """

    def __init__(self, config: EtcdConfig, url: str,
                 on_elected: Callable[[], Awaitable[None]],
                 on_deposed: Callable[[str], None]) -> None:
        self.config = config
        self.url = url
        self.id = f"{url}#{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.session = EtcdSession(config)
        self.lease = Lease(self.session, config.lease_ttl_s)
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        #: create revision of our leader key while we lead (the fencing token)
        self.token: int | None = None
        #: the leader's URL as last read (ours while we lead); None = no leader known
        self.leader_url: str | None = None
        self.leader_changes = 0  #: leaders seen (by any controller) since start
        self.etcd_reachable = False
        self._last_leader_id: str | None = None
        #: elected and ``on_elected`` done (the registry restored): see :attr:`serves`
        self.took_over = False
        self._task: asyncio.Task[None] | None = None
        #: set by :meth:`stop`: the election loop ends at its next turn even if the
        #: cancellation was lost (see :meth:`stop`)
        self._stopping = False
        self._down_since: float | None = None

    @property
    def is_leader(self) -> bool:
        """True while elected and the lease is valid by our own clock."""
        return self.token is not None and self.lease.valid()

    @property
    def serves(self) -> bool:
        """:attr:`is_leader` and the takeover done (``on_elected`` returned): until then the
        API answers as no leader (503), not with a registry not restored yet."""
        return self.took_over and self.is_leader

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="controller election")

    async def stop(self) -> None:
        """Stop campaigning; a leader revokes its lease so a standby takes over at once.

        The election task is cancelled, and also told to end (:attr:`_stopping`): on Python
        3.11 ``asyncio.wait_for`` returns its inner call's outcome when the cancellation
        lands in the same loop turn as that call ending, so a cancellation can be lost in an
        etcd call that just failed, and the loop would retry forever. For the same reason the
        task is cancelled again every 0.1 s while it runs, for at most ``STOP_WAIT_S``; a
        task still running then is left behind, and the session's close keeps it from
        reaching etcd again."""
        self._stopping = True
        if self._task is not None:
            task, self._task = self._task, None
            deadline = time.monotonic() + STOP_WAIT_S
            while not task.done() and (left := deadline - time.monotonic()) > 0:
                task.cancel()
                await asyncio.wait({task}, timeout=min(0.1, left))
            if not task.done():
                logger.warning("controller %s: the election task did not end within %g s of "
                               "its cancellation; left behind", self.url, STOP_WAIT_S)
                task.add_done_callback(retrieve_outcome)
            elif not task.cancelled() and (e := task.exception()) is not None:
                logger.warning("controller %s: the election task ended with %r", self.url, e)
        self.took_over = False
        if self.token is not None:
            self.token = None
            try:
                await asyncio.wait_for(self.lease.revoke(), 1.5)
                logger.info("controller %s: leadership handed back (lease revoked)", self.url)
            except (TimeoutError, EtcdUnavailable):
                pass
        await self.session.close()

    def step_down(self, reason: str) -> None:
        """Stop acting as leader now (idempotent)."""
        if self.token is None:
            return
        self.token = None
        self.took_over = False
        if self.leader_url == self.url:
            self.leader_url = None
        logger.warning("controller %s: no longer the leader: %s", self.url, reason)
        self.on_deposed(reason)

    # ---------------------------------------------------------------- loop
    async def _run(self) -> None:
        while not self._stopping:
            try:
                if self.token is None:
                    await self._follow_or_campaign()
                else:
                    await self._keep_alive()
                if self._down_since is not None:
                    logger.info("controller %s: etcd reachable again after %.1f s", self.url,
                                time.monotonic() - self._down_since)
                    self._down_since = None
                self.etcd_reachable = True
            except asyncio.CancelledError:
                raise
            except EtcdUnavailable as e:
                self.etcd_reachable = False
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    logger.warning("controller %s: %s; retrying", self.url, e)
                if self.token is not None and not self.lease.valid():
                    self.step_down(f"etcd unreachable for the lease TTL "
                                   f"({self.config.lease_ttl_s} s)")
                if self.token is None:
                    self.leader_url = None
                await asyncio.sleep(min(0.2, self.config.lease_ttl_s / 10))
            except Exception:  # pragma: no cover - a bug: keep campaigning
                logger.exception("controller %s: election loop failed; retrying", self.url)
                if self.token is not None:
                    self.step_down("election loop failed")
                await asyncio.sleep(0.5)

    async def _follow_or_campaign(self) -> None:
        rec, rev = await read_leader(self.session)
        if rec is not None:
            self._saw_leader(rec)
            await self._watch_leader(rev)
            return
        if not self.lease.valid(margin_s=1.0):
            await self.lease.revoke()
            await self.lease.grant()
        token = await campaign(self.session, self.lease,
                               {"id": self.id, "url": self.url, "since": time.time()})
        if token is None:
            return   # someone else was faster: follow it on the next round
        self.took_over = False
        self.token = token
        self.leader_url = self.url
        self._saw_leader({"id": self.id, "url": self.url})
        logger.info("controller %s: elected leader (etcd %s, lease %x, TTL %d s)", self.url,
                    self.session.endpoint, self.lease.id, self.config.lease_ttl_s)
        try:
            await self.on_elected()
            # (no await before this: a long poll woken by the takeover answers as leader)
            self.took_over = self.token == token
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.step_down(f"could not take over: {type(e).__name__}: {e}")
            await self.lease.revoke()
            if isinstance(e, EtcdUnavailable):
                raise
            await asyncio.sleep(0.5)

    def _saw_leader(self, rec: dict[str, object]) -> None:
        lid = str(rec.get("id"))
        url = rec.get("url")
        self.leader_url = url if isinstance(url, str) else None
        if lid != self._last_leader_id:
            self._last_leader_id = lid
            self.leader_changes += 1
            if lid != self.id:
                logger.info("controller %s: following leader %s", self.url, self.leader_url)

    async def _watch_leader(self, rev: int) -> None:
        """Return when ``P/leader`` changes after ``rev``, or after one TTL."""
        import aetcd
        ttl = float(self.config.lease_ttl_s)
        try:
            await self.session.call("watch_once", self.session.leader_key, timeout=ttl,
                                    start_revision=rev + 1, wait_s=ttl + 1.0)
        except aetcd.WatchTimeoutError:
            pass

    async def _keep_alive(self) -> None:
        period = self.config.lease_ttl_s / 3
        await asyncio.sleep(period)
        if self.token is None:
            return
        left = self.lease.valid_until - time.monotonic()
        if left <= 0:
            self.step_down("lease not renewed in time")
            return
        try:
            ok = await asyncio.wait_for(self.lease.refresh(), left)
        except TimeoutError:
            if not self.lease.valid():
                self.step_down("etcd did not renew the lease in time")
            return
        if not ok:
            self.step_down("etcd says the lease expired")
