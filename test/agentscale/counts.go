package agentscale

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/tokenbroker/tokenbroker/test/promtext"
)

// sum adds up the values of series.
func sum(series []promtext.Series) float64 {
	total := 0.0
	for _, s := range series {
		total += s.Value
	}
	return total
}

// brokerCalls sums every broker's answered API requests by "METHOD route".
func brokerCalls(ctx context.Context, brokers []*process) (map[string]int, error) {
	out := map[string]int{}
	for _, b := range brokers {
		samples, err := promtext.Get(ctx, "http://"+b.ops+"/metrics")
		if err != nil {
			return nil, err
		}
		for _, s := range samples["tokenbroker_http_requests_total"] {
			if s.Labels["listener"] == "api" {
				out[s.Labels["method"]+" "+s.Labels["route"]] += int(s.Value)
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
