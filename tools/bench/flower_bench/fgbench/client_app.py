"""A no-op Flower ClientApp: each train message is answered at once with the arrays it carried, num-examples 1.

The counterpart of fedguard's ``--trainer noop`` client (it returns the received model unchanged).
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Reply with the received ArrayRecord and a MetricRecord FedAvg weighs by (num-examples = 1)."""
    arrays = msg.content.array_records["arrays"]
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})
    return Message(content=content, reply_to=msg)
