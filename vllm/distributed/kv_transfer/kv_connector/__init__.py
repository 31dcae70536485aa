"""KV connectors: `KVConnectorFactory` builds one by name from `KVTransferConfig`."""
