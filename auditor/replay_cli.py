"""``verbatim replay <transcript-id>``: replay one transcript and print the verdict.

Two ways to run it:
- ``--url http://127.0.0.1:8000 --api-key KEY`` (or ``VERBATIM_URL`` / ``VERBATIM_API_KEY``): ask a
  running server (``POST /v1/transcripts/{id}/replay?wait=true``), as any HTTP client would;
- otherwise in this process, against the database and key ring of ``--data-dir`` /
  ``--database-url``: the engine is loaded here (``--model``, ``--device``, ``--engine-options`` or their
  ``VERBATIM_*`` variables, as the server would), the job is recorded in ``replay_jobs`` (requested by
  ``cli``) and its attestation appended to the log. Model loading and the replayed tokens show progress
  on stderr (a bar on a terminal, log lines otherwise).

Exit status: 0 match, 1 mismatch, 3 inconclusive_environment, 2 refused or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from auditor.cli_settings import ENGINE_SETTINGS, STORAGE_SETTINGS, prepare_storage, setting_flags, settings_from

EXIT = {"match": 0, "mismatch": 1, "inconclusive_environment": 3}


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``replay`` subcommand, registered in ``auditor.cli.plugin_commands``."""
    parser.add_argument("transcript_id", help="id of a deterministic transcript (see GET /v1/transcripts)")
    parser.add_argument("--url", help="replay on a running server at this base URL (env VERBATIM_URL)")
    parser.add_argument("--api-key", help="API key for --url (env VERBATIM_API_KEY)")
    parser.add_argument("--json", action="store_true", help="print the replay job as JSON")
    setting_flags(parser, (*ENGINE_SETTINGS, *STORAGE_SETTINGS))
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("VERBATIM_URL")
    try:
        job = _over_http(url, args) if url else asyncio.run(_in_process(args))
    except ReplayRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(job, indent=2) if args.json else render(job))
    if job["status"] != "done":
        return 2
    return EXIT[job["result"]]


class ReplayRefused(Exception):
    """The server (or the local service) refused the replay; the message says why."""


def _over_http(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    key = args.api_key or os.environ.get("VERBATIM_API_KEY")
    if not key:
        raise ReplayRefused("--url needs --api-key (or VERBATIM_API_KEY)")
    response = httpx.post(f"{url.rstrip('/')}/v1/transcripts/{args.transcript_id}/replay", params={"wait": "true"},
                          headers={"Authorization": f"Bearer {key}"}, timeout=900)
    body = response.json()
    if response.status_code >= 400:
        raise ReplayRefused(f"HTTP {response.status_code}: {body.get('error', {}).get('message', body)}")
    return body


async def _in_process(args: argparse.Namespace) -> dict[str, Any]:
    from engine import progress

    from auditor.app import attach_engine, build_services
    from auditor.engine_seam import load_engine
    from auditor.errors import ApiError
    from auditor.replay import ReplayService

    settings = settings_from(args)
    progress.log_to_stderr()
    await asyncio.to_thread(prepare_storage, settings)
    services = build_services(settings)
    engine = None
    meter = progress.Meter(f"replay {args.transcript_id}", "token")
    try:
        engine = await asyncio.to_thread(load_engine, settings)
        await engine.start()
        attach_engine(services, engine)
        with progress.stage(f"replay of transcript {args.transcript_id}"):
            return await ReplayService(services).run_now(args.transcript_id, on_progress=meter.update)
    except ApiError as exc:
        raise ReplayRefused(f"{exc.message} ({exc.code})") from None
    finally:
        meter.close()
        if engine is not None:
            await engine.shutdown()
        await services.db.dispose()
        if services.redis is not None:
            await services.redis.aclose()


def render(job: dict[str, Any]) -> str:
    """A few human-readable lines about a finished (or failed) replay job."""
    head = f"replay {job['id']} of transcript {job['transcript_id']}: "
    if job["status"] != "done":
        return head + f"{job['status'].upper()}" + (f" ({job['error']})" if job.get("error") else "")
    details = job["details"] or {}
    lines = [head + job["result"].upper()]
    if details.get("executed"):
        windows = f"{details['windows']} window" + ("" if details["windows"] == 1 else "s")
        lines.append(f"  {details['tokens']} tokens in {windows}; tokens match: "
                     f"{_yes(details['tokens_match'])}, signed output commitment: "
                     f"{_yes(details['output_commitment_match'])}, signed logprob digest: "
                     f"{_yes(details['logprob_digest_match'])}")
    divergence = details if job["result"] == "mismatch" else details.get("divergence")
    if divergence and divergence.get("position") is not None:
        lines.append(f"  first divergence at output position {divergence['position']} (window "
                     f"{divergence['window_index']} {divergence['window']}): expected token "
                     f"{divergence['expected_token']}, replayed {divergence['replayed_token']}")
        if divergence.get("corrected_matches_commitment"):
            lines.append("  with the replayed token there, the stored ids open the signed commitment: the record was "
                         "altered at that position and the engine reproduces what was signed")
    for name, diff in (details.get("differences") or {}).items():
        lines.append(f"  environment differs: {name}: recorded {diff['recorded']!r}, now {diff['current']!r}")
    if details.get("reason"):
        lines.append(f"  not executed: {details['reason']}")
    failed = [name for name, ok in (details.get("record_checks") or {}).items() if not ok]
    if failed:
        lines.append(f"  stored record does not match its signed commitments: {', '.join(failed)}")
    lines.append(f"  signed replay attestation appended to the log at index {job['log_index']}")
    return "\n".join(lines)


def _yes(value: bool) -> str:
    return "yes" if value else "NO"
