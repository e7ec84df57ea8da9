package llmstream;

import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardCopyOption;
import java.util.TreeMap;

import org.apache.flink.api.common.operators.MailboxExecutor;
import org.apache.flink.metrics.Gauge;
import org.apache.flink.runtime.state.StateSnapshotContext;
import org.apache.flink.streaming.api.operators.AbstractStreamOperator;
import org.apache.flink.streaming.api.operators.OneInputStreamOperator;
import org.apache.flink.streaming.runtime.streamrecord.StreamRecord;
import org.apache.flink.streaming.runtime.tasks.mailbox.TaskMailbox;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * The inference stage's admission gate: a pass-through operator chained in front of the Python
 * stage (same subtask, same host) that stops taking input while the stage says it admits
 * nothing (a spend budget paused until its window rolls over), without holding a checkpoint.
 *
 * <p>The stage says so with a file, {@code <directory>/<subtask>.closed}, which exists while it
 * is paused (the Python worker is another process; `udfs/lanes/admission.py`). After forwarding a record
 * the gate looks at that file (at most every {@code checkMillis}); while it exists, the gate
 * stays in {@code processElement} and runs the task's mails instead of returning for the next
 * record. Its mailbox executor has the lowest priority, so it runs every mail: timers (the
 * stage emits the answers that still come in) and, under unaligned checkpoints, the barrier,
 * which a non-source task receives as a mail. An executor of the operator's own priority never
 * lets a barrier through (measured; `TaskMailboxImpl.takeOrNull` takes only mails of at least
 * the executor's priority), and an aligned barrier waits in the input, which the gate is not
 * reading: hence unaligned checkpoints.
 *
 * <p>The gate holds no record: the one in hand has already gone to the stage, which keeps what
 * it cannot start yet in its own keyed state. So the gate has no state, and a checkpoint taken
 * while it waits is whole.
 *
 * <p>With {@code publishDurable} it also tells the stage which of its state is durable, something a Python function cannot
 * learn from PyFlink: when a checkpoint completes, the gate writes {@code <directory>/<subtask>.durable}
 * holding the wall-clock time (epoch ms) at which that checkpoint's barrier reached this subtask.
 * Whatever the stage did to its state before that moment is in a completed checkpoint. The
 * provider-batch lane (`udfs/lanes/provider_batch/lane.py`) creates a batch only once its entry is durable,
 * so a restore always knows every batch it made and never pays for one twice.
 */
public final class AdmissionGate<T> extends AbstractStreamOperator<T> implements OneInputStreamOperator<T, T> {

    private static final long serialVersionUID = 1L;
    private static final Logger LOG = LoggerFactory.getLogger(AdmissionGate.class);

    private final String directory;
    private final long checkMillis;
    private final long idleSleepMillis;
    private final boolean publishDurable;

    private transient Path signal;
    private transient Path durable;
    private transient TreeMap<Long, Long> barrierMillis;
    private transient MailboxExecutor anyMail;
    private transient long nextCheckNanos;
    private transient boolean closed;
    private transient long closedSinceNanos;
    private transient long closedNanosTotal;

    public AdmissionGate(String directory, long checkMillis, long idleSleepMillis) {
        this(directory, checkMillis, idleSleepMillis, false);
    }

    /** {@code publishDurable}: write {@code <subtask>.durable} (the provider-batch lane reads it). */
    public AdmissionGate(String directory, long checkMillis, long idleSleepMillis, boolean publishDurable) {
        this.directory = directory;
        this.checkMillis = checkMillis;
        this.idleSleepMillis = idleSleepMillis;
        this.publishDurable = publishDurable;
    }

    @Override
    public void open() throws Exception {
        super.open();
        int subtask = getRuntimeContext().getTaskInfo().getIndexOfThisSubtask();
        signal = Paths.get(directory, subtask + ".closed");
        durable = Paths.get(directory, subtask + ".durable");
        barrierMillis = new TreeMap<>();
        anyMail = getContainingTask().getMailboxExecutorFactory().createExecutor(TaskMailbox.MIN_PRIORITY);
        getMetricGroup().gauge("admissionGateClosed", (Gauge<Integer>) () -> closed ? 1 : 0);
        getMetricGroup().gauge("admissionGateClosedMs", (Gauge<Long>) () -> (closedNanosTotal
                + (closed ? System.nanoTime() - closedSinceNanos : 0)) / 1_000_000);
        LOG.info("admission gate of subtask {} follows {}", subtask, signal);
    }

    @Override
    public void processElement(StreamRecord<T> element) throws Exception {
        output.collect(element);
        if (look(false)) {
            holdWhileClosed();
        }
    }

    @Override
    public void snapshotState(StateSnapshotContext context) throws Exception {
        super.snapshotState(context);
        barrierMillis.put(context.getCheckpointId(), System.currentTimeMillis());
    }

    @Override
    public void notifyCheckpointComplete(long checkpointId) throws Exception {
        super.notifyCheckpointComplete(checkpointId);
        Long at = barrierMillis.get(checkpointId);
        barrierMillis.headMap(checkpointId, true).clear();
        if (at == null || !publishDurable) {
            return;
        }
        try {
            Files.createDirectories(durable.getParent());
            Path partial = Paths.get(directory, durable.getFileName() + ".partial");
            Files.write(partial, Long.toString(at).getBytes(StandardCharsets.US_ASCII));
            Files.move(partial, durable, StandardCopyOption.REPLACE_EXISTING, StandardCopyOption.ATOMIC_MOVE);
        } catch (java.io.IOException e) {
            LOG.warn("admission gate: writing {} failed: {}", durable, e.toString());
        }
    }

    /** Whether the stage is paused; reads the file at most every checkMillis unless {@code now}. */
    private boolean look(boolean now) {
        long at = System.nanoTime();
        if (now || at >= nextCheckNanos) {
            nextCheckNanos = at + checkMillis * 1_000_000;
            boolean isClosed = Files.exists(signal);
            if (isClosed != closed) {
                closed = isClosed;
                if (isClosed) {
                    closedSinceNanos = at;
                    LOG.info("admission gate closed: the inference stage admits nothing ({})", signal);
                } else {
                    closedNanosTotal += at - closedSinceNanos;
                    LOG.info("admission gate open again after {} ms", (at - closedSinceNanos) / 1_000_000);
                }
            }
        }
        return closed;
    }

    private void holdWhileClosed() throws Exception {
        while (look(true)) {
            if (!anyMail.tryYield()) {
                Thread.sleep(idleSleepMillis);
            }
        }
    }
}
