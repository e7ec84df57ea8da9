package llmstream;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.streaming.api.operators.AbstractStreamOperator;
import org.apache.flink.streaming.api.operators.OneInputStreamOperator;
import org.apache.flink.streaming.api.watermark.Watermark;
import org.apache.flink.streaming.runtime.streamrecord.StreamRecord;
import org.apache.flink.types.Row;

/**
 * Carries up to {@code size} input records of one bucket across the JVM-Python crossing as one
 * element: {@code Row(bucket, rec)} in, {@code Row(bucket, Row[] recs)} out
 * ({@code python.crossing_batch}, jobs/pipeline.py).
 *
 * <p>Why: the Beam crossing into the Python stage costs per element, not per byte (docs/
 * performance.md, "Batching the crossing"), so N records in one element pay it once.
 *
 * <p>It holds no state and nothing across a checkpoint: every buffered record goes downstream in
 * {@link #prepareSnapshotPreBarrier}, before the barrier, so the stage has it in its own state
 * when the snapshot is taken. A bucket's buffer also goes out when it is full, at the latest
 * {@code maxDelayMillis} after its first record (a processing-time timer), before a watermark
 * (the stage's end-of-input timer fires on the final one) and at the end of input. A tick
 * ({@code rec == null}) sends its bucket's buffer first and then passes as {@code Row(bucket, null)}.
 * Records keep their order within a bucket, which {@code ordering: per_key} relies on.
 */
public final class CrossingBatcher extends AbstractStreamOperator<Row> implements OneInputStreamOperator<Row, Row> {

    private static final long serialVersionUID = 1L;

    private final int size;
    private final long maxDelayMillis;

    private transient Map<Object, List<Row>> buffers;
    private transient boolean timerSet;

    public CrossingBatcher(int size, long maxDelayMillis) {
        this.size = size;
        this.maxDelayMillis = maxDelayMillis;
    }

    @Override
    public void open() throws Exception {
        super.open();
        buffers = new LinkedHashMap<>();
    }

    @Override
    public void processElement(StreamRecord<Row> element) throws Exception {
        Row in = element.getValue();
        Object bucket = in.getField(0);
        Row rec = (Row) in.getField(1);
        if (rec == null) {
            send(bucket);
            output.collect(new StreamRecord<>(Row.of(bucket, null)));
            return;
        }
        List<Row> buffer = buffers.computeIfAbsent(bucket, b -> new ArrayList<>(size));
        buffer.add(rec);
        if (buffer.size() >= size) {
            send(bucket);
        } else if (!timerSet) {
            timerSet = true;
            long now = getProcessingTimeService().getCurrentProcessingTime();
            getProcessingTimeService().registerTimer(now + maxDelayMillis, at -> {
                timerSet = false;
                sendAll();
            });
        }
    }

    @Override
    public void processWatermark(Watermark mark) throws Exception {
        sendAll();
        super.processWatermark(mark);
    }

    @Override
    public void prepareSnapshotPreBarrier(long checkpointId) throws Exception {
        sendAll();
        super.prepareSnapshotPreBarrier(checkpointId);
    }

    @Override
    public void finish() throws Exception {
        sendAll();
        super.finish();
    }

    private void send(Object bucket) {
        List<Row> buffer = buffers.remove(bucket);
        if (buffer != null && !buffer.isEmpty()) {
            output.collect(new StreamRecord<>(Row.of(bucket, buffer.toArray(new Row[0]))));
        }
    }

    private void sendAll() {
        if (buffers.isEmpty()) {
            return;
        }
        for (Object bucket : new ArrayList<>(buffers.keySet())) {
            send(bucket);
        }
    }
}
