package llmstream;

import org.apache.flink.connector.datagen.source.GeneratorFunction;
import org.apache.flink.types.Row;

/**
 * The ticks of a gated job: {@code (bucket, null)} rows for the inference stage's buckets, one
 * slot after another, for Flink's {@code DataGeneratorSource} (a FLIP-27 source).
 *
 * <p>The SQL {@code datagen} connector that ticks an ungated job runs as a legacy source, whose
 * thread holds the checkpoint lock while it waits for a network buffer: behind a closed
 * admission gate its buffers fill and no checkpoint barrier leaves it, so no checkpoint
 * completes (measured). A FLIP-27 source waits for buffers in its mailbox and lets the barrier
 * through.
 */
public final class Ticks implements GeneratorFunction<Long, Row> {

    private static final long serialVersionUID = 1L;

    private final int[] slots;

    public Ticks(int[] slots) {
        this.slots = slots.clone();
    }

    @Override
    public Row map(Long index) {
        return Row.of(slots[(int) (index % slots.length)], null);
    }
}
