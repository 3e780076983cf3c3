package agentscale

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// sample is one sample of a scraped metric.
type sample struct {
	labels map[string]string
	value  float64
}

// sum adds up samples.
func sum(samples []sample) float64 {
	total := 0.0
	for _, s := range samples {
		total += s.value
	}
	return total
}

// scrape fetches a /metrics exposition: the samples of its counters,
// gauges and untyped metrics by name.
func scrape(ctx context.Context, url string) (map[string][]sample, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: status %d", url, resp.StatusCode)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", url, err)
	}
	out := map[string][]sample{}
	for name, fam := range fams {
		for _, m := range fam.GetMetric() {
			s := sample{labels: map[string]string{}}
			for _, l := range m.GetLabel() {
				s.labels[l.GetName()] = l.GetValue()
			}
			switch {
			case m.Counter != nil:
				s.value = m.GetCounter().GetValue()
			case m.Gauge != nil:
				s.value = m.GetGauge().GetValue()
			case m.Untyped != nil:
				s.value = m.GetUntyped().GetValue()
			default:
				continue
			}
			out[name] = append(out[name], s)
		}
	}
	return out, nil
}

// brokerCalls sums every broker's answered API requests by "METHOD route".
func brokerCalls(ctx context.Context, brokers []*process) (map[string]int, error) {
	out := map[string]int{}
	for _, b := range brokers {
		samples, err := scrape(ctx, "http://"+b.ops+"/metrics")
		if err != nil {
			return nil, err
		}
		for _, s := range samples["tokenbroker_http_requests_total"] {
			if s.labels["listener"] == "api" {
				out[s.labels["method"]+" "+s.labels["route"]] += int(s.value)
			}
		}
	}
	return out, nil
}

// diff returns b − a by key, leaving out zeros.
func diff(b, a map[string]int) map[string]int {
	out := map[string]int{}
	for k, v := range b {
		if d := v - a[k]; d != 0 {
			out[k] = d
		}
	}
	return out
}

// auditEvent is the part of an audit.k8s.io/v1 Event that is counted.
type auditEvent struct {
	Stage string `json:"stage"`
	Verb  string `json:"verb"`
	User  struct {
		Username string `json:"username"`
	} `json:"user"`
	RequestReceived time.Time `json:"requestReceivedTimestamp"`
}

// auditCalls counts AgentUser's requests in the audit log by verb: those
// received before split, and those received from split to end.
func auditCalls(file string, split, end time.Time) (before, between map[string]int, err error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	before, between = map[string]int{}, map[string]int{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var ev auditEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, nil, fmt.Errorf("audit log %s: %w", file, err)
		}
		// A request has one ResponseComplete event, or Panic; a watch
		// would add ResponseStarted, which the agent never opens.
		if ev.User.Username != AgentUser || (ev.Stage != "ResponseComplete" && ev.Stage != "Panic") {
			continue
		}
		switch {
		case ev.RequestReceived.Before(split):
			before[ev.Verb]++
		case !ev.RequestReceived.After(end):
			between[ev.Verb]++
		}
	}
	return before, between, sc.Err()
}
