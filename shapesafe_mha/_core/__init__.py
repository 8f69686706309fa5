"""The checking core: errors, dimension names, the contract and its verdicts, messages, the observation point.

The error hierarchy (`errors`), the vocabulary of dimension names (`dims`), the contract every checked
function goes through (`contract`: sessions, one memo of verdicts), the messages that explain a failure
(`messages`), the observation point that traces and proofs record through (`trace`), the weights bundle
(`weights`), the probe conversions verify themselves on (`probe`), and the decorator users put on their own
functions (`shapecheck`). It imports nothing else of shapesafe_mha.
"""
