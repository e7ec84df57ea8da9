package llmstream;

import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.java.typeutils.RowTypeInfo;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.streaming.api.functions.python.DataStreamPythonFunctionInfo;
import org.apache.flink.streaming.api.operators.python.process.AbstractExternalDataStreamPythonFunctionOperator;
import org.apache.flink.streaming.api.operators.python.process.ExternalPythonKeyedProcessOperator;
import org.apache.flink.streaming.runtime.streamrecord.StreamRecord;
import org.apache.flink.types.Row;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * PyFlink's keyed Python operator with a bundle size that follows throughput
 * ({@code python.bundle_target_ms}): each bundle holds about {@code targetMillis} of input records.
 *
 * <p>Why: a checkpoint barrier makes the operator finish its bundle, which waits until Python has
 * taken every element sent in it; under a backlog those wait for free call slots, so the wait is
 * about bundle size / throughput. A fixed size must be small for a slow model (100 records: 0.5 s
 * at 200 records/s), and every bundle end costs a fixed amount (Beam's bundle round trip, the
 * metrics of every Python gauge parsed in {@code FlinkMetricContainer.updateMetrics}), which a
 * fast model pays hundreds of times a second. Here a bundle also ends once it holds
 * {@code rate x targetMillis} input records (between {@code minSize} and the configured
 * {@code python.fn-execution.bundle.size}, which stays the ceiling on its elements), where rate is
 * the input records of the last bundles over the time they spanned: with a backlog that is the
 * stage's throughput, without one the input's rate. Only records count: timers (the stage's
 * 20 ms emit timers, many a second) never wait for a slot, and counting them let a bundle of
 * mostly records grow to seconds of work under a backlog (measured).
 *
 * <p>The bundle time ({@code python.fn-execution.bundle.time}) still ends a bundle that fills
 * slowly; everything else is the base class's.
 */
public final class AdaptiveBundles<OUT> extends ExternalPythonKeyedProcessOperator<OUT> {

    private static final long serialVersionUID = 1L;
    private static final Logger LOG = LoggerFactory.getLogger(AdaptiveBundles.class);

    private final long targetMillis;
    private final int minSize;

    private transient int recordLimit;
    private transient int records;
    private transient double rate;
    private transient long bundleStartNanos;
    private transient long bundles;

    public AdaptiveBundles(Configuration config, DataStreamPythonFunctionInfo info, RowTypeInfo inputType,
                           TypeInformation<OUT> outputType, long targetMillis, int minSize) {
        super(config, info, inputType, outputType);
        this.targetMillis = targetMillis;
        this.minSize = minSize;
    }

    /** The operator PyFlink made for {@code KeyedStream.process}, with adaptive bundles. */
    public static <OUT> AdaptiveBundles<OUT> of(ExternalPythonKeyedProcessOperator<OUT> made, long targetMillis,
                                                int minSize) {
        return new AdaptiveBundles<>(made.getConfiguration(), made.getPythonFunctionInfo(),
                (RowTypeInfo) made.getInputTypeInfo(), made.getProducedType(), targetMillis, minSize);
    }

    @Override
    public void open() throws Exception {
        super.open();
        maxBundleSize = Math.max(maxBundleSize, minSize);
        recordLimit = minSize;  // grows with the first bundles' rate
        bundleStartNanos = System.nanoTime();
        LOG.info("adaptive bundles: about {} ms of input records, between {} and {}", targetMillis, minSize,
                maxBundleSize);
    }

    @Override
    public void processElement(StreamRecord<Row> element) throws Exception {
        records++;  // before the base class checks the count
        super.processElement(element);
    }

    @Override
    protected void checkInvokeFinishBundleByCount() throws Exception {
        if (records >= recordLimit || elementCount >= maxBundleSize) {
            invokeFinishBundle();
        }
    }

    @Override
    protected void invokeFinishBundle() throws Exception {
        int taken = records;
        super.invokeFinishBundle();
        records = 0;
        long now = System.nanoTime();
        if (taken > 0) {
            double seconds = Math.max(now - bundleStartNanos, 1_000_000L) / 1e9;
            double measured = taken / seconds;
            rate = rate == 0 ? measured : 0.5 * rate + 0.5 * measured;
            recordLimit = (int) Math.max(minSize, Math.min(maxBundleSize, Math.round(rate * targetMillis / 1000.0)));
            if (++bundles % 1024 == 0) {  // a line every few minutes at most
                LOG.info("adaptive bundles: {} input records/s, at most {} a bundle", Math.round(rate), recordLimit);
            }
        }
        bundleStartNanos = now;
    }

    @Override
    public <T> AbstractExternalDataStreamPythonFunctionOperator<T> copy(DataStreamPythonFunctionInfo info,
                                                                          TypeInformation<T> outputType) {
        return new AdaptiveBundles<>(config, info, (RowTypeInfo) getInputTypeInfo(), outputType, targetMillis, minSize);
    }
}
