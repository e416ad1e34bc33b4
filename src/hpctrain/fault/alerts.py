"""Webhook alerts on failure, requeue, hang or completion.

The URL is a credential: it comes from the environment (HPCTRAIN_ALERT_WEBHOOK) or
a file named in the config, never from the command line, and is never printed or
logged (errors show only its host and the exception's type: urllib's messages quote
the URL). A malformed URL is refused before training (resolve_webhook). Sending never
raises: a dead webhook must not fail a training run. Plain JSON carries every field;
Slack-compatible hooks (Slack, Mattermost, Rocket.Chat) get {"text": ...}, Discord
{"content": ...}.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hpctrain.config.schema import AlertSection
from hpctrain.dist.env import ALERT_WEBHOOK, alert_webhook_url
from hpctrain.errors import UserError

log = logging.getLogger("hpctrain")


class MalformedWebhook(ValueError):
    """A URL that cannot be sent to; the message says why and never quotes it."""


def resolve_webhook(cfg: AlertSection) -> str:
    """The URL from the environment, else from alert.webhook_file, else ''. A malformed one is bad input
    (UserError, found before training): left to the first alert, it would fail silently mid-run."""
    url = alert_webhook_url()
    if url:
        return checked_webhook(url, f"the environment variable {ALERT_WEBHOOK}",
                               f"set {ALERT_WEBHOOK} to the URL alone, or put it in a file named by "
                               "alert.webhook_file (chmod 600)")
    if not cfg.webhook_file:
        return ""
    try:
        text = Path(cfg.webhook_file).expanduser().read_text()
    except OSError as err:
        raise UserError(
            f"cannot read alert.webhook_file '{cfg.webhook_file}': {err.strerror or err}",
            "write the webhook URL into that file (chmod 600), or set HPCTRAIN_ALERT_WEBHOOK.",
        ) from None
    except UnicodeDecodeError:  # its message quotes no content, but says nothing useful either
        raise UserError(f"alert.webhook_file '{cfg.webhook_file}' is not a text file",
                        "write the webhook URL alone into that file (chmod 600).") from None
    return checked_webhook(text.strip(), f"alert.webhook_file '{cfg.webhook_file}'",
                           "the file must hold the URL alone, on one line (chmod 600)")


def checked_webhook(url: str, where: str, hint: str) -> str:
    """``url`` when it can be sent to; otherwise a UserError that names ``where`` and never quotes the URL."""
    problem = webhook_problem(url)
    if problem:
        raise UserError(f"{where}: the webhook URL {problem}", hint)
    return url


def webhook_problem(url: str) -> str:
    """What makes ``url`` unusable as a webhook, '' if nothing. Never quotes it: it is a credential."""
    if "\n" in url or "\r" in url:
        return "contains a line break (a second line after the URL)"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "contains a space or a control character (write a space in a URL as %20)"
    if not url.isascii():
        return "contains a non-ASCII character (percent-encode it)"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing it raises ValueError for a bad port
    except ValueError:
        return "cannot be parsed (check the host and port, e.g. an unclosed '[' or a port above 65535)"
    if parts.scheme not in ("http", "https"):
        return "does not start with https:// or http://"
    if not parts.hostname:
        return "has no host"
    return ""


def webhook_host(url: str) -> str:
    """The URL's host, for messages; '?' when there is none or it looks unlike a host (never more of the URL)."""
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:  # e.g. an unclosed '[' of an IPv6 address
        return "?"
    return host if re.fullmatch(r"[\w.:-]+", host) else "?"


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
        """POST the alert; True when the webhook answered 2xx. Never raises (but KeyboardInterrupt, SystemExit):
        it runs on the failure, requeue and hang paths, where an exception would stop the requeue or hide the
        failure it reports."""
        if not self.enabled(event):
            return False
        fields = {**self.base, "event": event, "time": time.time(), "last_step": last_step,
                  "exit_code": exit_code, "detail": detail, "log_tail": log_tail or []}
        try:
            return self._post(event, build_payload(choose_format(self.cfg.format, self.url), fields))
        except Exception as err:  # noqa: BLE001 - urllib and http.client raise many types, with the URL in their text
            log.warning("alert '%s' to webhook at %s failed: %s (training is not affected)",
                        event, webhook_host(self.url), failure_reason(err))
            return False

    def _post(self, event: str, payload: dict[str, Any]) -> bool:
        problem = webhook_problem(self.url)
        if problem:  # resolve_webhook refuses these up front; an Alerter built otherwise must not send them
            raise MalformedWebhook(problem)
        request = urllib.request.Request(self.url, data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
            if 200 <= response.status < 300:
                return True
        log.warning("alert '%s' to webhook at %s: HTTP %s", event, webhook_host(self.url), response.status)
        return False


def failure_reason(err: BaseException) -> str:
    """Why a send failed, without the URL: the exception's type, plus an HTTP status or an OS error's own text.
    Other messages (InvalidURL, ValueError, UnicodeEncodeError, ...) may quote the URL or its path."""
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code}"
    if isinstance(err, urllib.error.URLError) and isinstance(err.reason, BaseException):
        err = err.reason  # the socket error inside
    if isinstance(err, MalformedWebhook):
        return f"the URL {err}"
    if isinstance(err, OSError) and isinstance(err.strerror, str):
        return f"{type(err).__name__}: {err.strerror}"
    return type(err).__name__
