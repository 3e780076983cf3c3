package e2e

import (
	"encoding/json"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"
)

// TestTheExampleAlertsAreValidPromQLOverTheDocumentedMetrics holds the
// example PrometheusRule of docs/operations.md to the code: it is a
// well-formed monitoring.coreos.com/v1 PrometheusRule; every expression
// parses with Prometheus's own parser (test/promqlcheck); every metric it
// selects is in the metrics tables of operations.md or agent.md, which list
// exactly the metrics the Go code registers; and every label it matches or
// groups on is one those tables give the metric (or a label Prometheus adds
// to every target).
func TestTheExampleAlertsAreValidPromQLOverTheDocumentedMetrics(t *testing.T) {
	documented := documentedMetrics(t)
	registered := registeredMetrics(t)
	for name := range documented {
		require.True(t, registered[name], "the docs list %s, which nothing registers", name)
	}
	for name := range registered {
		require.Contains(t, documented, name, "%s is registered but missing from the metrics tables of the docs", name)
	}

	rules := exampleAlerts(t)
	names := make([]string, len(rules))
	exprs := make([]string, len(rules))
	for i, r := range rules {
		names[i], exprs[i] = r.Alert, r.Expr
	}
	requireQueriesOverDocumentedMetrics(t, documented, names, exprs)
	t.Logf("%d alerts parsed and checked against %d documented metrics", len(rules), len(documented))
}

// requireDocumentedExposition checks a real /metrics answer of the broker
// or the agent against the metrics tables of the docs: every tokenbroker_
// family it exports is documented with exactly the labels it has, and
// there are at least min of them.
func requireDocumentedExposition(t *testing.T, exposition string, min int) {
	t.Helper()
	documented := documentedMetrics(t)
	p := expfmt.NewTextParser(model.LegacyValidation)
	families, err := p.TextToMetricFamilies(strings.NewReader(exposition))
	require.NoError(t, err)
	n := 0
	for name, mf := range families {
		if !strings.HasPrefix(name, "tokenbroker_") {
			continue
		}
		want, ok := documented[name]
		require.True(t, ok, "the broker exports %s, which the docs do not list", name)
		want = slices.DeleteFunc(slices.Clone(want), func(l string) bool { return l == "le" })
		slices.Sort(want)
		for _, m := range mf.GetMetric() {
			var got []string
			for _, lp := range m.GetLabel() {
				got = append(got, lp.GetName())
			}
			slices.Sort(got)
			require.Equal(t, want, append([]string{}, got...), "%s: the labels the broker exports and the labels the docs list", name)
		}
		n++
	}
	require.GreaterOrEqual(t, n, min, "most metrics have series by now")
	t.Logf("%d exported tokenbroker_ metric families match the docs", n)
}

// targetLabels are the labels Prometheus (with the Prometheus Operator's
// ServiceMonitor) puts on every series of a target.
var targetLabels = map[string]bool{"job": true, "instance": true, "namespace": true, "pod": true, "service": true, "container": true, "endpoint": true}

// alertRule is one alerting rule of the example PrometheusRule.
type alertRule struct {
	Alert       string            `json:"alert"`
	Expr        string            `json:"expr"`
	For         string            `json:"for"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

// exampleAlerts reads the PrometheusRule of docs/operations.md strictly and
// returns its rules, checking the shape the Prometheus Operator needs.
func exampleAlerts(t *testing.T) []alertRule {
	t.Helper()
	var rule struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name      string            `json:"name"`
			Namespace string            `json:"namespace"`
			Labels    map[string]string `json:"labels"`
		} `json:"metadata"`
		Spec struct {
			Groups []struct {
				Name  string      `json:"name"`
				Rules []alertRule `json:"rules"`
			} `json:"groups"`
		} `json:"spec"`
	}
	text := fencedBlock(t, readDoc(t, "docs/operations.md"), "yaml", "apiVersion: monitoring.coreos.com/v1")
	require.NoError(t, yaml.UnmarshalStrict([]byte(text), &rule))
	require.Equal(t, "monitoring.coreos.com/v1", rule.APIVersion)
	require.Equal(t, "PrometheusRule", rule.Kind)
	require.NotEmpty(t, rule.Metadata.Name)
	require.NotEmpty(t, rule.Spec.Groups)
	durationRE := regexp.MustCompile(`^([0-9]+(ms|s|m|h|d|w|y))+$`)
	seen := map[string]bool{}
	var out []alertRule
	for _, g := range rule.Spec.Groups {
		require.NotEmpty(t, g.Name)
		require.NotEmpty(t, g.Rules)
		for _, r := range g.Rules {
			require.NotEmpty(t, r.Alert)
			require.False(t, seen[r.Alert], "alert %s twice", r.Alert)
			seen[r.Alert] = true
			require.NotEmpty(t, r.Expr, r.Alert)
			require.NotEmpty(t, r.Labels["severity"], r.Alert)
			require.NotEmpty(t, r.Annotations["summary"], r.Alert)
			if r.For != "" {
				require.Regexp(t, durationRE, r.For, r.Alert)
			}
			out = append(out, r)
		}
	}
	return out
}

// documentedMetrics reads the metrics tables of docs/operations.md (the
// broker) and docs/agent.md (the agent): metric name to its labels.
func documentedMetrics(t *testing.T) map[string][]string {
	t.Helper()
	row := regexp.MustCompile("^\\| `(tokenbroker_[a-z0-9_]+)` \\| (counter|gauge|histogram) \\|([^|]*)\\|")
	label := regexp.MustCompile("`([a-z_]+)`")
	out := map[string][]string{}
	for _, doc := range []string{"docs/operations.md", "docs/agent.md"} {
		for _, line := range strings.Split(readDoc(t, doc), "\n") {
			m := row.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			require.NotContains(t, out, m[1], "%s is documented twice", m[1])
			labels := []string{}
			for _, l := range label.FindAllStringSubmatch(m[3], -1) {
				labels = append(labels, l[1])
			}
			if m[2] == "histogram" {
				labels = append(labels, "le")
			}
			out[m[1]] = labels
		}
	}
	require.Contains(t, out, "tokenbroker_issuances_total")
	require.Contains(t, out, "tokenbroker_agent_refresh_total")
	return out
}

// metricLabels returns the labels of a documented metric, also for the
// _bucket, _sum and _count series of a histogram.
func metricLabels(documented map[string][]string, name string) ([]string, bool) {
	if strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_") {
		// The Go runtime and process collectors ("go_*, process_*" in
		// the table): no labels of their own.
		return []string{}, true
	}
	if l, ok := documented[name]; ok {
		return l, true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if l, ok := documented[strings.TrimSuffix(name, suffix)]; ok && strings.HasSuffix(name, suffix) {
			return l, true
		}
	}
	return nil, false
}

// registeredMetrics finds the tokenbroker_ metric names the Go code
// registers, in the files that define the metrics.
func registeredMetrics(t *testing.T) map[string]bool {
	t.Helper()
	nameRE := regexp.MustCompile(`"(tokenbroker_[a-z0-9_]+)"`)
	out := map[string]bool{}
	// Every non-test file of the packages that register metrics and the
	// packages below them: most are in broker/metrics, some next to what
	// they count (the ClusterTrustBundle publisher's).
	var files []string
	for _, dir := range []string{"broker", "server", "agent"} {
		err := filepath.WalkDir(filepath.Join(repoRoot(t), dir), func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && d.Name() == "testdata" {
				return filepath.SkipDir
			}
			if !d.IsDir() && strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
				files = append(files, path)
			}
			return nil
		})
		require.NoError(t, err)
	}
	for _, f := range files {
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range nameRE.FindAllStringSubmatch(string(src), -1) {
			out[m[1]] = true
		}
	}
	require.Contains(t, out, "tokenbroker_http_requests_total")
	return out
}

// promqlResult is what test/promqlcheck says of one expression.
type promqlResult struct {
	Expr      string `json:"expr"`
	Error     string `json:"error"`
	Selectors []struct {
		Metric string `json:"metric"`
		Labels []struct {
			Name, Op, Value string
		} `json:"labels"`
	} `json:"selectors"`
	Groupings []struct {
		Labels  []string `json:"labels"`
		Metrics []string `json:"metrics"`
	} `json:"groupings"`
}

// promqlCheck parses exprs with Prometheus's parser, built from
// test/promqlcheck (a module of its own).
func promqlCheck(t *testing.T, exprs []string) []promqlResult {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "promqlcheck")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = filepath.Join(repoRoot(t), "test", "promqlcheck")
	out, err := build.CombinedOutput()
	require.NoError(t, err, string(out))
	in, err := json.Marshal(exprs)
	require.NoError(t, err)
	cmd := exec.Command(bin)
	cmd.Stdin = strings.NewReader(string(in))
	out, err = cmd.Output()
	require.NoError(t, err)
	var res []promqlResult
	require.NoError(t, json.Unmarshal(out, &res))
	require.Len(t, res, len(exprs))
	return res
}

func TestPromQLCheckFindsWhatTheAlertTestRelieson(t *testing.T) {
	res := promqlCheck(t, []string{
		`sum by (reason) (rate(tokenbroker_denials_total{action="issue"}[5m]))`,
		`rate(tokenbroker_denials_total[5m`,
	})
	require.Empty(t, res[0].Error)
	require.Equal(t, "tokenbroker_denials_total", res[0].Selectors[0].Metric)
	require.Equal(t, "action", res[0].Selectors[0].Labels[0].Name)
	require.Equal(t, []string{"reason"}, res[0].Groupings[0].Labels)
	require.NotEmpty(t, res[1].Error, "a broken expression is reported")
}

// requireQueriesOverDocumentedMetrics checks PromQL expressions (named for
// the messages) with Prometheus's own parser: each parses, every metric it
// selects is in the docs' metrics tables, and every label it matches or
// groups on is one those tables give the metric (or a target label).
func requireQueriesOverDocumentedMetrics(t *testing.T, documented map[string][]string, names, exprs []string) {
	t.Helper()
	for i, res := range promqlCheck(t, exprs) {
		alert := names[i]
		require.Empty(t, res.Error, "%s: %s", alert, res.Expr)
		for _, sel := range res.Selectors {
			if sel.Metric == "up" {
				continue
			}
			labels, ok := metricLabels(documented, sel.Metric)
			require.True(t, ok, "%s selects %s, which is not a documented metric", alert, sel.Metric)
			for _, m := range sel.Labels {
				require.True(t, slices.Contains(labels, m.Name) || targetLabels[m.Name],
					"%s matches %s on label %q, which it does not have (it has %v)", alert, sel.Metric, m.Name, labels)
			}
		}
		for _, g := range res.Groupings {
			var have []string
			for _, name := range g.Metrics {
				labels, _ := metricLabels(documented, name)
				have = append(have, labels...)
			}
			for _, l := range g.Labels {
				require.True(t, slices.Contains(have, l) || targetLabels[l],
					"%s groups by %q, which none of %v has", alert, l, g.Metrics)
			}
		}
	}
}

// TestEveryShippedAlertHasPromtoolTests holds test/alerts (the promtool unit
// tests `make alerts-test` runs) to the alerts the charts ship: every alert
// has a case where it fires, with its labels and annotations, and one where
// it does not; no test names an alert that is not shipped. With bin/promtool
// (make promtool) it also runs them.
func TestEveryShippedAlertHasPromtoolTests(t *testing.T) {
	root := repoRoot(t)
	type ruleFile []struct {
		Name  string `json:"name"`
		Rules []struct {
			Alert string `json:"alert"`
		} `json:"rules"`
	}
	type testFile struct {
		RuleFiles []string `json:"rule_files"`
		Tests     []struct {
			AlertRuleTest []struct {
				Alertname string            `json:"alertname"`
				ExpAlerts []json.RawMessage `json:"exp_alerts"`
			} `json:"alert_rule_test"`
		} `json:"tests"`
	}
	dir := t.TempDir()
	for _, c := range []struct{ chart, test string }{
		{"tokenbroker", "broker.test.yaml"},
		{"tokenbroker-agent", "agent.test.yaml"},
	} {
		src, err := os.ReadFile(filepath.Join(root, "deploy", "helm", c.chart, "files", "alerts.yaml"))
		require.NoError(t, err)
		var groups ruleFile
		require.NoError(t, yaml.Unmarshal(src, &groups))
		shipped := map[string]bool{}
		for _, g := range groups {
			for _, r := range g.Rules {
				shipped[r.Alert] = true
			}
		}
		require.NotEmpty(t, shipped)
		rules := c.chart + ".rules.yaml"
		require.NoError(t, os.WriteFile(filepath.Join(dir, rules), append([]byte("groups:\n"), src...), 0o600))

		raw, err := os.ReadFile(filepath.Join(root, "test", "alerts", c.test))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, c.test), raw, 0o600))
		var tf testFile
		require.NoError(t, yaml.Unmarshal(raw, &tf))
		require.Equal(t, []string{rules}, tf.RuleFiles, c.test)
		fires, quiet := map[string]bool{}, map[string]bool{}
		for _, tc := range tf.Tests {
			for _, a := range tc.AlertRuleTest {
				require.True(t, shipped[a.Alertname], "%s tests %s, which %s does not ship", c.test, a.Alertname, c.chart)
				if len(a.ExpAlerts) > 0 {
					fires[a.Alertname] = true
				} else {
					quiet[a.Alertname] = true
				}
			}
		}
		for name := range shipped {
			require.True(t, fires[name], "%s: no test where %s fires", c.test, name)
			require.True(t, quiet[name], "%s: no test where %s stays quiet", c.test, name)
		}
	}

	promtool := filepath.Join(root, "bin", "promtool")
	if _, err := os.Stat(promtool); err != nil {
		t.Skipf("no %s (make promtool builds it; make alerts-test runs these tests)", promtool)
	}
	out, err := exec.Command(promtool, "test", "rules", filepath.Join(dir, "broker.test.yaml"), filepath.Join(dir, "agent.test.yaml")).CombinedOutput()
	require.NoError(t, err, string(out))
	t.Logf("promtool: %s", strings.TrimSpace(string(out)))
}
