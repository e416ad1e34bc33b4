"""Webhook alerts on failure, requeue, hang or completion.

The URL is a credential: it comes from the environment (HPCTRAIN_ALERT_WEBHOOK) or
a file named in the config, never from the command line, and is never printed or
logged (errors show only its host). Sending never raises: a dead webhook must not
fail a training run. Plain JSON carries every field; Slack-compatible hooks
(Slack, Mattermost, Rocket.Chat) get {"text": ...}, Discord {"content": ...}.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hpctrain.config.schema import AlertSection
from hpctrain.dist.env import alert_webhook_url
from hpctrain.errors import UserError

log = logging.getLogger("hpctrain")


def resolve_webhook(cfg: AlertSection) -> str:
    """The URL from the environment, else from alert.webhook_file, else ''."""
    url = alert_webhook_url()
    if url or not cfg.webhook_file:
        return url
    try:
        return Path(cfg.webhook_file).expanduser().read_text().strip()
    except OSError as err:
        raise UserError(
            f"cannot read alert.webhook_file '{cfg.webhook_file}': {err.strerror or err}",
            "write the webhook URL into that file (chmod 600), or set HPCTRAIN_ALERT_WEBHOOK.",
        ) from None


def webhook_host(url: str) -> str:
    return urlsplit(url).hostname or "?"


def choose_format(fmt: str, url: str) -> str:
    if fmt != "auto":
        return fmt
    host = webhook_host(url)
    if "discord" in host:
        return "discord"
    if "slack" in host or "mattermost" in host or "rocket" in host or url.rstrip("/").endswith("/slack"):
        return "slack"
    return "json"


def summary_text(fields: dict[str, Any]) -> str:
    head = f"[hpctrain] {fields['event'].upper()}: run '{fields['run']}'"
    where = f"job {fields['job_id'] or '-'} on {fields['host']}, rank {fields['rank']}"
    parts = [head, where, f"last step {fields['last_step']}"]
    if fields.get("exit_code") is not None:
        parts.append(f"exit code {fields['exit_code']}")
    if fields.get("detail"):
        parts.append(str(fields["detail"]))
    text = " | ".join(parts)
    if fields.get("log_tail"):
        text += "\n```\n" + "\n".join(fields["log_tail"][-15:]) + "\n```"
    return text


def build_payload(fmt: str, fields: dict[str, Any]) -> dict[str, Any]:
    if fmt == "slack":
        return {"text": summary_text(fields)}
    if fmt == "discord":
        return {"content": summary_text(fields)[:1900]}  # Discord caps messages at 2000 characters
    return fields


class Alerter:
    def __init__(self, url: str, cfg: AlertSection, run: str, run_dir: str, job_id: str, rank: int) -> None:
        self.url, self.cfg = url, cfg
        self.base = {"run": run, "run_dir": run_dir, "job_id": job_id, "host": socket.gethostname(), "rank": rank}

    def enabled(self, event: str) -> bool:
        return bool(self.url) and event in self.cfg.events

    def send(self, event: str, *, last_step: int, exit_code: int | None = None, detail: str = "",
             log_tail: list[str] | None = None) -> bool:
        """POST the alert; True when the webhook answered 2xx. Never raises."""
        if not self.enabled(event):
            return False
        fields = {**self.base, "event": event, "time": time.time(), "last_step": last_step,
                  "exit_code": exit_code, "detail": detail, "log_tail": log_tail or []}
        body = json.dumps(build_payload(choose_format(self.cfg.format, self.url), fields)).encode()
        try:  # Request() itself raises ValueError with the URL in its text for a malformed URL
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
                ok = 200 <= response.status < 300
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = type(err).__name__ if isinstance(err, ValueError) else str(getattr(err, "reason", err))
            log.warning("alert '%s' to webhook at %s failed: %s (training is not affected)",
                        event, webhook_host(self.url), reason)
            return False
        if not ok:
            log.warning("alert '%s' to webhook at %s: HTTP %s", event, webhook_host(self.url), response.status)
        return ok
