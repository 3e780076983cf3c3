package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/tokenbroker/tokenbroker/agent/client"
	"github.com/tokenbroker/tokenbroker/agent/config"
	"github.com/tokenbroker/tokenbroker/agent/execcred"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// ClusterProfileGVR is the ClusterProfile resource of
// sigs.k8s.io/cluster-inventory-api. The agent writes it with the dynamic
// client so that the root module does not depend on that module.
var ClusterProfileGVR = schema.GroupVersionResource{Group: "multicluster.x-k8s.io", Version: "v1alpha1", Resource: "clusterprofiles"}

// The ClusterProfile API's names the output writes.
const (
	// FieldManagerAgent is the server-side apply field manager of
	// everything the agent writes on a ClusterProfile.
	FieldManagerAgent = "tokenbroker-agent"
	// LabelClusterManager is the label a cluster manager sets on the
	// profiles it manages (cluster-inventory-api LabelClusterManagerKey).
	LabelClusterManager = "x-k8s.io/cluster-manager"
	// ConditionControlPlaneHealthy is the condition multicluster-runtime
	// requires True before it connects to a cluster.
	ConditionControlPlaneHealthy = "ControlPlaneHealthy"
	// The reasons of ControlPlaneHealthy the agent sets.
	ReasonBrokerIssues      = "BrokerIssues"
	ReasonBrokerUnreachable = "BrokerUnreachable"
	ReasonBrokerRefuses     = "BrokerRefuses"
)

// maxConditionMessage bounds the condition message (the API allows 32768).
const maxConditionMessage = 1024

// clusterProfileOutput is the access provider entry of a target on a
// ClusterProfile (ClusterProfileOutput). It holds no credential.
type clusterProfileOutput struct {
	cfg  config.ClusterProfileOutput
	name string
	api  dynamic.ResourceInterface
	now  func() time.Time
}

var _ output = (*clusterProfileOutput)(nil)
var _ healthReporter = (*clusterProfileOutput)(nil)

// healthReporter is the optional ability of an output to say that the
// broker could not be asked (or refused); the refresher finds it by type
// assertion. A successful write says the opposite.
type healthReporter interface {
	reportHealth(ctx context.Context, meta outputMeta, err error) (bool, error)
}

func newClusterProfileOutput(cfg config.ClusterProfileOutput, target string, dyn dynamic.Interface, now func() time.Time) *clusterProfileOutput {
	name := cfg.Name
	if name == "" {
		name = target
	}
	return &clusterProfileOutput{cfg: cfg, name: name, api: dyn.Resource(ClusterProfileGVR).Namespace(cfg.Namespace), now: now}
}

func (o *clusterProfileOutput) String() string {
	return "clusterprofile:" + o.cfg.Namespace + "/" + o.name
}

// read: the entry holds no credential, so there is none to adopt.
func (o *clusterProfileOutput) read(context.Context) (*stored, error) { return nil, nil }

// accessProvider is the agent's entry: the cluster of the broker's
// kubeconfig, as a kubeconfig v1 Cluster (the JSON names of
// clientcmdv1.Cluster), with the target as its exec extension. For a
// gateway target that cluster is the lease gateway and the extension says
// access gateway, so that the plugin hands out a gateway credential where
// client-go will send it (the plugin's guard checks both against the
// broker's answer).
func accessProvider(meta outputMeta, c *Credential) (map[string]any, error) {
	if c.Server == "" || len(c.CAData) == 0 {
		return nil, errors.New("the broker's kubeconfig has no server or no certificate-authority-data, which a ClusterProfile entry needs")
	}
	ext, err := json.Marshal(execcred.NewPluginTarget(meta.broker, apiv1.RequestSpec(meta.req)))
	if err != nil {
		return nil, fmt.Errorf("render the exec extension: %w", err)
	}
	var extension map[string]any
	if err := json.Unmarshal(ext, &extension); err != nil {
		return nil, fmt.Errorf("render the exec extension: %w", err)
	}
	cluster := map[string]any{
		"server":                     c.Server,
		"certificate-authority-data": c.CAData, // []byte: base64 in JSON, as kubeconfigs have it
		"extensions":                 []any{map[string]any{"name": apiv1.ExecExtensionKey, "extension": extension}},
	}
	if c.TLSServerName != "" {
		cluster["tls-server-name"] = c.TLSServerName
	}
	if c.ProxyURL != "" {
		cluster["proxy-url"] = c.ProxyURL
	}
	// Through JSON, so that it compares equal to what the API server
	// returns (numbers, base64 strings).
	return jsonValue(map[string]any{"name": config.AccessProviderName, "cluster": cluster})
}

// jsonValue is v as encoding/json decodes it into an interface.
func jsonValue(v any) (map[string]any, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// write sets the agent's entry (and, as manager, ControlPlaneHealthy
// True) when they differ from what the profile holds.
func (o *clusterProfileOutput) write(ctx context.Context, meta outputMeta, c *Credential) (bool, error) {
	entry, err := accessProvider(meta, c)
	if err != nil {
		return false, err
	}
	return o.apply(ctx, entry, &metav1.Condition{Type: ConditionControlPlaneHealthy, Status: metav1.ConditionTrue,
		Reason: ReasonBrokerIssues, Message: "the broker at " + meta.broker + " issues credentials for this cluster"})
}

// reportHealth sets ControlPlaneHealthy False after a failed request to
// the broker, if the agent is the manager; the entry stays as it is.
// The message is fixed per cause (the error itself goes to the log), so
// that a broker that stays away does not make a write per attempt.
func (o *clusterProfileOutput) reportHealth(ctx context.Context, meta outputMeta, cause error) (bool, error) {
	if o.cfg.ClusterManager == "" {
		return false, nil
	}
	reason := ReasonBrokerUnreachable
	msg := "the broker at " + meta.broker + " does not answer"
	var pe *client.ProblemError
	if errors.As(cause, &pe) {
		msg = fmt.Sprintf("the broker at %s answers %d", meta.broker, pe.Status)
		if pe.Status < 500 && pe.Status != 429 {
			reason = ReasonBrokerRefuses
		}
	}
	if len(msg) > maxConditionMessage {
		msg = msg[:maxConditionMessage]
	}
	return o.apply(ctx, nil, &metav1.Condition{Type: ConditionControlPlaneHealthy, Status: metav1.ConditionFalse, Reason: reason, Message: msg})
}

// apply writes entry (nil: keep the one there) and, as manager, cond,
// with server-side apply under FieldManagerAgent, only if that changes the
// profile. The ClusterProfile CRD of cluster-inventory-api (as MultiKueue
// v0.17 pins it) makes status.accessProviders and status.conditions atomic
// lists, so the apply carries the lists as read with only the agent's
// entry and condition replaced, under the resourceVersion read: a
// concurrent writer makes it fail (and the refresher retry) rather than
// lose that writer's entries.
func (o *clusterProfileOutput) apply(ctx context.Context, entry map[string]any, cond *metav1.Condition) (bool, error) {
	cur, err := o.api.Get(ctx, o.name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		if o.cfg.ClusterManager == "" {
			return false, fmt.Errorf("ClusterProfile %s/%s does not exist, and this output is not its manager (clusterManager is unset): its cluster manager must create it", o.cfg.Namespace, o.name)
		}
		cur, err = o.create(ctx)
	}
	if err != nil {
		return false, fmt.Errorf("ClusterProfile %s/%s: %w", o.cfg.Namespace, o.name, err)
	}
	if o.cfg.ClusterManager != "" {
		if m, _, _ := unstructured.NestedString(cur.Object, "spec", "clusterManager", "name"); m != o.cfg.ClusterManager {
			return false, fmt.Errorf("ClusterProfile %s/%s is managed by %q, not %q: set clusterManager to that or leave it unset", o.cfg.Namespace, o.name, m, o.cfg.ClusterManager)
		}
	} else {
		cond = nil
	}

	providers, _, _ := unstructured.NestedSlice(cur.Object, "status", "accessProviders")
	conditions, _, _ := unstructured.NestedSlice(cur.Object, "status", "conditions")
	changed := false
	if entry != nil {
		var set bool
		providers, set = setListEntry(providers, "name", config.AccessProviderName, entry)
		changed = changed || set
	}
	if cond != nil {
		var set bool
		conditions, set = setCondition(conditions, *cond, o.now())
		changed = changed || set
	}
	if !changed {
		return false, nil
	}
	status := map[string]any{"accessProviders": providers}
	if conditions == nil {
		conditions = []any{}
	}
	status["conditions"] = conditions
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": ClusterProfileGVR.GroupVersion().String(),
		"kind":       "ClusterProfile",
		"metadata":   map[string]any{"name": o.name, "namespace": o.cfg.Namespace, "resourceVersion": cur.GetResourceVersion()},
		"status":     status,
	}}
	if _, err := o.api.ApplyStatus(ctx, o.name, obj, metav1.ApplyOptions{FieldManager: FieldManagerAgent, Force: true}); err != nil {
		return false, fmt.Errorf("apply the status of ClusterProfile %s/%s: %w", o.cfg.Namespace, o.name, err)
	}
	return true, nil
}

// create makes the ClusterProfile as its cluster manager.
func (o *clusterProfileOutput) create(ctx context.Context) (*unstructured.Unstructured, error) {
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": ClusterProfileGVR.GroupVersion().String(),
		"kind":       "ClusterProfile",
		"metadata": map[string]any{
			"name": o.name, "namespace": o.cfg.Namespace,
			"labels": map[string]any{LabelClusterManager: o.cfg.ClusterManager},
		},
		"spec": map[string]any{"displayName": o.name, "clusterManager": map[string]any{"name": o.cfg.ClusterManager}},
	}}
	return o.api.Apply(ctx, o.name, obj, metav1.ApplyOptions{FieldManager: FieldManagerAgent})
}

// setListEntry replaces (or appends) the element of list whose key field
// is value with want; it reports whether that changed anything.
func setListEntry(list []any, key, value string, want map[string]any) ([]any, bool) {
	out := make([]any, 0, len(list)+1)
	found, changed := false, false
	for _, e := range list {
		m, ok := e.(map[string]any)
		if ok && m[key] == value {
			if found {
				changed = true // a duplicate of ours: drop it
				continue
			}
			found = true
			if !reflect.DeepEqual(m, want) {
				changed = true
			}
			out = append(out, want)
			continue
		}
		out = append(out, e)
	}
	if !found {
		out = append(out, want)
		changed = true
	}
	return out, changed
}

// setCondition sets cond in conditions as meta.SetStatusCondition does:
// lastTransitionTime moves only when the status does. It reports whether
// anything (status, reason, message) changed.
func setCondition(conditions []any, cond metav1.Condition, now time.Time) ([]any, bool) {
	for i, e := range conditions {
		m, ok := e.(map[string]any)
		if !ok || m["type"] != cond.Type {
			continue
		}
		if m["status"] == string(cond.Status) && m["reason"] == cond.Reason && m["message"] == cond.Message {
			return conditions, false
		}
		next := map[string]any{"type": cond.Type, "status": string(cond.Status), "reason": cond.Reason, "message": cond.Message,
			"lastTransitionTime": m["lastTransitionTime"]}
		if m["status"] != string(cond.Status) || m["lastTransitionTime"] == nil {
			next["lastTransitionTime"] = now.UTC().Format(time.RFC3339)
		}
		out := append([]any{}, conditions...)
		out[i] = next
		return out, true
	}
	return append(append([]any{}, conditions...), map[string]any{"type": cond.Type, "status": string(cond.Status), "reason": cond.Reason,
		"message": cond.Message, "lastTransitionTime": now.UTC().Format(time.RFC3339)}), true
}
