"""S3 event notifications read from an SQS queue: the upload sensor's trigger for big buckets.

The input bucket notifies the queue on `s3:ObjectCreated:*` (docs/TRIGGERS.md shows the two AWS
calls); `batch_upload_sensor` then drains the queue instead of listing the bucket, so a tick costs
what was uploaded since the last one, however many objects the bucket holds.

Exactly once across daemon restarts: a received message stays invisible for
INPUT_QUEUE_VISIBILITY_SECONDS. The tick that received it returns its run requests with the
message's receipt handle in the cursor; Dagster stores the cursor together with the run requests,
and the *next* tick deletes the messages the cursor names. A daemon that dies before the run
requests were stored never stored that cursor: the message comes back once invisible time is over
and is read again. A message read twice (SQS delivers at least once) asks for the same run key,
which Dagster starts only once.

Uses the same endpoint, credentials, retries and timeouts as the S3 client (AWS_ENDPOINT_URL ...).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus

from botocore.exceptions import BotoCoreError, ClientError

from batch_pipeline.io import storage

RECEIVE_BATCH = 10  # SQS's most per ReceiveMessage / DeleteMessageBatch call
RECEIVE_WAIT_SECONDS = 1  # long polling: short polls can come back empty while messages wait


class QueueError(RuntimeError):
    """The queue cannot be read; the message names INPUT_QUEUE_URL and what SQS said."""


def sqs_client() -> Any:
    """The process-wide SQS client (storage.aws_client: the S3 client's environment, retries and
    timeouts; storage.reset_clients() forgets both)."""
    return storage.aws_client("sqs")


@dataclass(frozen=True)
class Message:
    id: str
    receipt: str
    body: str


@dataclass(frozen=True)
class Created:
    """One object an event says was created."""

    uri: str
    event: str  # e.g. ObjectCreated:Put


def _call(queue_url: str, what: str, fn: Any, **kwargs: Any) -> Any:
    try:
        return fn(QueueUrl=queue_url, **kwargs)
    except (ClientError, BotoCoreError) as e:
        code = e.response.get("Error", {}).get("Code", "") if isinstance(e, ClientError) else type(e).__name__
        raise QueueError(f"INPUT_QUEUE_URL={queue_url}: {what} failed ({code}): {e}") from e


def receive(queue_url: str, visibility_seconds: int, max_messages: int = RECEIVE_BATCH) -> list[Message]:
    reply = _call(
        queue_url, "ReceiveMessage", sqs_client().receive_message,
        MaxNumberOfMessages=max(1, min(max_messages, RECEIVE_BATCH)),
        VisibilityTimeout=visibility_seconds,
        WaitTimeSeconds=RECEIVE_WAIT_SECONDS,
    )
    return [Message(m["MessageId"], m["ReceiptHandle"], m.get("Body", "")) for m in reply.get("Messages", ())]


def _chunks(items: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(items), RECEIVE_BATCH):
        yield items[start : start + RECEIVE_BATCH]


def delete(queue_url: str, receipts: list[str]) -> list[str]:
    """Delete the messages; returns SQS's reasons for those it would not delete (an expired
    receipt: the message is visible again and will be read, and deduplicated, once more)."""
    failed: list[str] = []
    for chunk in _chunks(receipts):
        entries = [{"Id": str(i), "ReceiptHandle": r} for i, r in enumerate(chunk)]
        reply = _call(queue_url, "DeleteMessageBatch", sqs_client().delete_message_batch, Entries=entries)
        failed.extend(f"{f.get('Code', '')}: {f.get('Message', '')}" for f in reply.get("Failed", ()))
    return failed


def release(queue_url: str, receipts: list[str]) -> None:
    """Make received messages visible again at once (received beyond this tick's cap)."""
    for chunk in _chunks(receipts):
        entries = [{"Id": str(i), "ReceiptHandle": r, "VisibilityTimeout": 0} for i, r in enumerate(chunk)]
        _call(queue_url, "ChangeMessageVisibilityBatch", sqs_client().change_message_visibility_batch, Entries=entries)


def created_objects(body: str) -> tuple[list[Created], str]:
    """The objects an S3 event notification says were created, or ([], why the message is not one).

    Accepts the S3 event structure (`Records[].s3.bucket.name/object.key`, keys URL-encoded) sent
    directly to SQS or wrapped in an SNS notification (`{"Type": "Notification", "Message": ...}`)."""
    try:
        data = json.loads(body)
    except ValueError:
        return [], "not JSON"
    if isinstance(data, dict) and data.get("Type") == "Notification" and isinstance(data.get("Message"), str):
        return created_objects(data["Message"])
    if not isinstance(data, dict):
        return [], "not a JSON object"
    if data.get("Event") == "s3:TestEvent":
        return [], "S3's test event (sent when the notification is configured)"
    records = data.get("Records")
    if not isinstance(records, list):
        return [], "no Records: not an S3 event notification"
    created: list[Created] = []
    for record in records:
        try:
            event = str(record.get("eventName", ""))
            bucket = record["s3"]["bucket"]["name"]
            key = unquote_plus(record["s3"]["object"]["key"])
        except (KeyError, TypeError, AttributeError):
            continue
        if event.startswith("ObjectCreated"):
            created.append(Created(f"s3://{bucket}/{key}", event))
    if not created:
        return [], "no ObjectCreated record"
    return created, ""
