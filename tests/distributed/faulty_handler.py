"""A function that fails on one chosen task, for the coordinator's error-path tests."""

from lambdas.handler import handler as real_handler


def handler(event, context=None):
    if event["task"] == "AV_BWD" and event["epoch"] == 2 and event["interval"] == 1:
        raise ValueError("injected failure")
    return real_handler(event, context)
