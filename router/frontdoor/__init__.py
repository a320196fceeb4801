"""The router's front doors: the gRPC and OpenAI HTTP services, their codecs, one validation of a
request's limits, the detokenizer and the record of each request's outcome."""
