"""What a job runs on: the pinned JVM jars, the JVM's class-data archive, processes and ports."""
