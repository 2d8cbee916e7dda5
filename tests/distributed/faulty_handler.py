"""A function that fails on one chosen task, for the coordinator's error-path tests."""

from lambdas.handler import handler as real_handler


def handler(event, context=None):
    if event["task"] == "AV_BWD" and event["epoch"] == 2 and event["interval"] == 1:
        raise ValueError("injected failure")
    return real_handler(event, context)


def hanging_handler(event, context=None):
    """Never returns from one call of epoch 3: a function that stopped making progress."""
    if event["task"] == "AV" and event["epoch"] == 3 and event["interval"] == 0:
        import time

        time.sleep(3600)
    return real_handler(event, context)


def recording_handler(event, context=None):
    """The real function, appending (task, pass, part, interval, epoch, layer, weights, version) of
    every call that succeeded to the JSON-lines file named by $DORYLUS_TEST_CALLS."""
    import json
    import os

    result = real_handler(event, context)
    record = {k: event[k] for k in ("task", "pass", "part", "interval", "epoch", "layer", "weights", "attempt")}
    record["version"] = result["result"].get("version")
    with open(os.environ["DORYLUS_TEST_CALLS"], "a") as out:
        out.write(json.dumps(record) + "\n")
    return result
