package metrics

import "github.com/prometheus/client_golang/prometheus"

// The constructors below are how every tokenbroker metric is declared:
// the domain metrics of this package, the server's HTTP and lease gateway
// metrics, and the agent's. A metric is its name, its help text and its
// variable labels, nothing else (no namespace, subsystem or constant
// labels), so that the name in the code is the name on the scrape page,
// the one the charts' alerts and the dashboard query.

// NewCounter declares a counter without labels.
func NewCounter(name, help string) prometheus.Counter {
	return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
}

// NewCounterVec declares a counter with the given variable labels.
func NewCounterVec(name, help string, labels ...string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
}

// NewGauge declares a gauge without labels.
func NewGauge(name, help string) prometheus.Gauge {
	return prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
}

// NewGaugeVec declares a gauge with the given variable labels.
func NewGaugeVec(name, help string, labels ...string) *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels)
}

// NewHistogram declares a histogram without labels, with the given
// bucket upper bounds.
func NewHistogram(name, help string, buckets []float64) prometheus.Histogram {
	return prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets})
}

// NewHistogramVec declares a histogram with the given bucket upper bounds
// and variable labels.
func NewHistogramVec(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, labels)
}

// Register registers each collector with reg, in order, and returns the
// first error (a name registered twice, a label set that conflicts with a
// registered one): a registry refusing a metric is a programming error,
// found by the first test that builds the component.
func Register(reg prometheus.Registerer, collectors ...prometheus.Collector) error {
	for _, c := range collectors {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
