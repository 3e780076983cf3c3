// Package promtext reads Prometheus text expositions (a /metrics answer)
// for the benchmarks: each family's series with their labels and one
// value.
package promtext

import (
	"context"
	"fmt"
	"io"
	"net/http"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Series is one series of an exposition: its labels and its value (a
// counter's, a gauge's or an untyped metric's; a histogram's or a
// summary's sum).
type Series struct {
	Labels map[string]string
	Value  float64
}

// Parse reads an exposition: each family's series by the family's name.
func Parse(r io.Reader) (map[string][]Series, error) {
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, err
	}
	out := make(map[string][]Series, len(fams))
	for name, mf := range fams {
		for _, m := range mf.GetMetric() {
			s := Series{Labels: make(map[string]string, len(m.GetLabel()))}
			for _, l := range m.GetLabel() {
				s.Labels[l.GetName()] = l.GetValue()
			}
			switch {
			case m.Counter != nil:
				s.Value = m.GetCounter().GetValue()
			case m.Gauge != nil:
				s.Value = m.GetGauge().GetValue()
			case m.Untyped != nil:
				s.Value = m.GetUntyped().GetValue()
			case m.Histogram != nil:
				s.Value = m.GetHistogram().GetSampleSum()
			case m.Summary != nil:
				s.Value = m.GetSummary().GetSampleSum()
			}
			out[name] = append(out[name], s)
		}
	}
	return out, nil
}

// Get reads the exposition at url (plain HTTP: an operations listener).
func Get(ctx context.Context, url string) (map[string][]Series, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: status %d", url, resp.StatusCode)
	}
	fams, err := Parse(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	return fams, nil
}
