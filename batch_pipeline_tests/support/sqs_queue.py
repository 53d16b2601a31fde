"""An SQS queue on the test's moto server that a bucket notifies of its uploads, as INPUT_QUEUE_URL
expects (S3 event notifications on ObjectCreated).

Holds a boto3 SQS client for the moto server (`sqs_client`), a new queue with the bucket's
notification configuration pointing at it (`notifying_queue`) and the queue's visible and in-flight
message counts (`queue_depth`). Used by test_sensor_queue.py (the sensor draining the queue
in-process), test_dagster_e2e.py (the same through a real `dagster dev`) and test_doctor.py (the
upload sensor check).
"""

from __future__ import annotations

import uuid
from typing import Any

import boto3

from batch_pipeline_tests.support.s3_server import REGION, MotoS3


def sqs_client(moto_server: MotoS3) -> Any:
    return boto3.session.Session().client(
        "sqs", endpoint_url=moto_server.endpoint_url, aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name=REGION,
    )


def notifying_queue(moto_server: MotoS3, bucket: str, prefix: str = "incoming/") -> str:
    """A new SQS queue that `bucket` notifies on every ObjectCreated under `prefix` (the two calls
    an operator makes, docs/TRIGGERS.md); returns its URL."""
    sqs = sqs_client(moto_server)
    url = sqs.create_queue(QueueName=f"uploads-{uuid.uuid4().hex[:12]}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    moto_server.client().put_bucket_notification_configuration(
        Bucket=bucket,
        NotificationConfiguration={"QueueConfigurations": [{
            "QueueArn": arn, "Events": ["s3:ObjectCreated:*"],
            "Filter": {"Key": {"FilterRules": [{"Name": "prefix", "Value": prefix}]}},
        }]},
    )
    return url


def queue_depth(moto_server: MotoS3, url: str) -> tuple[int, int]:
    """(visible, in flight) messages."""
    attributes = sqs_client(moto_server).get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]), int(attributes["ApproximateNumberOfMessagesNotVisible"])
