"""Build tools: protobuf stubs (protogen) and the config schema/reference (config_schema)."""
