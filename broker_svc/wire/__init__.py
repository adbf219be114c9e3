"""Wire formats, pure: codecs, AMQP and event fields, ids; task/, results/ and records/ by role."""
