package execcred

import (
	"bytes"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// Cluster is spec.cluster of client-go's request: the cluster the
// credential will be sent to, which client-go gives the plugin when the
// exec stanza sets provideClusterInfo (a ClusterProfile access provider
// always does).
type Cluster struct {
	// Server is the URL client-go sends the credential to.
	Server string
	// CAData is the PEM bundle client-go verifies Server with.
	CAData []byte
	// Target is spec.cluster.config when it is a PluginTarget; nil when
	// there is no config.
	Target *PluginTarget
}

// PluginTarget is the content of the client.authentication.k8s.io/exec
// extension the plugin reads (apiv1.PluginTarget); the agent's
// ClusterProfile output writes it (NewPluginTarget).
type PluginTarget = apiv1.PluginTarget

// NewPluginTarget is apiv1.NewPluginTarget.
var NewPluginTarget = apiv1.NewPluginTarget

// execCluster is spec.cluster as client-go writes it (clientauthentication
// v1 and v1beta1 Cluster): only the fields the plugin reads.
type execCluster struct {
	Server string          `json:"server"`
	CAData []byte          `json:"certificate-authority-data"`
	Config json.RawMessage `json:"config"`
}

// maxTargetField bounds each string of a PluginTarget, and maxAudiences
// their number: the broker's own limits are lower, and an error must fit
// on a line.
const (
	maxTargetField = 1024
	maxAudiences   = 16
)

// parseCluster reads spec.cluster. A config that is JSON null or absent
// leaves Target nil; any other config must be a PluginTarget of a version
// the plugin knows, with no field it does not know.
func parseCluster(c *execCluster) (*Cluster, error) {
	out := &Cluster{Server: c.Server, CAData: c.CAData}
	raw := bytes.TrimSpace(c.Config)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return out, nil
	}
	t, err := ParsePluginTarget(raw)
	if err != nil {
		return nil, fmt.Errorf("spec.cluster.config: %w", err)
	}
	out.Target = t
	return out, nil
}

// ParsePluginTarget decodes the content of the
// client.authentication.k8s.io/exec extension (spec.cluster.config):
// strictly, one JSON object, apiVersion and kind as apiv1 names them, a
// broker URL and a namespace. Errors quote nothing but the apiVersion and
// kind, shortened.
func ParsePluginTarget(raw []byte) (*PluginTarget, error) {
	if len(raw) > MaxExecInfoBytes {
		return nil, fmt.Errorf("%d bytes, over the limit of %d", len(raw), MaxExecInfoBytes)
	}
	// The type first, so that another plugin's config is named as such
	// rather than as a field this one does not know.
	var tm struct {
		APIVersion any `json:"apiVersion"`
		Kind       any `json:"kind"`
	}
	if err := json.Unmarshal(raw, &tm); err != nil {
		return nil, errors.New("not a JSON object")
	}
	if tm.APIVersion != apiv1.PluginTargetAPIVersion || tm.Kind != apiv1.PluginTargetKind {
		return nil, fmt.Errorf("%q %q is not a target this plugin reads (apiVersion %s, kind %s)",
			short(fmt.Sprint(tm.APIVersion)), short(fmt.Sprint(tm.Kind)), apiv1.PluginTargetAPIVersion, apiv1.PluginTargetKind)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var t PluginTarget
	if err := dec.Decode(&t); err != nil {
		var typ *json.UnmarshalTypeError
		if errors.As(err, &typ) && typ.Field != "" {
			// Every key of a target is at the top level; Field also names
			// the embedded RequestSpec the key belongs to, which is Go's,
			// not the document's.
			key := typ.Field[strings.LastIndexByte(typ.Field, '.')+1:]
			return nil, fmt.Errorf("%s must not be a JSON %s", short(key), typ.Value)
		}
		if strings.HasPrefix(err.Error(), "json: unknown field ") {
			return nil, fmt.Errorf("unknown field %s: not in %s %s (written for a newer plugin, or mistyped)",
				short(strings.TrimPrefix(err.Error(), "json: unknown field ")), apiv1.PluginTargetAPIVersion, apiv1.PluginTargetKind)
		}
		return nil, errors.New("not a JSON object")
	}
	if dec.More() {
		return nil, errors.New("more than one JSON value")
	}
	var errs []error
	for name, v := range map[string]string{"broker": t.Broker, "namespace": t.Namespace, "serviceAccount": t.ServiceAccount,
		"ttl": t.TTL, "minTTL": t.MinTTL, "credential": t.Credential, "access": t.Access} {
		if len(v) > maxTargetField {
			errs = append(errs, fmt.Errorf("%s is over %d bytes", name, maxTargetField))
		}
	}
	if len(t.Audiences) > maxAudiences {
		errs = append(errs, fmt.Errorf("more than %d audiences", maxAudiences))
	}
	for _, a := range t.Audiences {
		if len(a) > maxTargetField {
			errs = append(errs, fmt.Errorf("an audience is over %d bytes", maxTargetField))
			break
		}
	}
	if t.Broker == "" {
		errs = append(errs, errors.New("broker is required"))
	} else if u, err := url.Parse(t.Broker); err != nil || u.Scheme != "https" || u.Host == "" {
		errs = append(errs, errors.New("broker must be an https:// URL"))
	}
	if t.Namespace == "" {
		errs = append(errs, errors.New("namespace is required"))
	}
	switch t.Credential {
	case "", apiv1.CredentialToken, apiv1.CredentialClientCertificate:
	default:
		errs = append(errs, fmt.Errorf("credential must be %s or %s", apiv1.CredentialToken, apiv1.CredentialClientCertificate))
	}
	switch t.Access {
	case "", apiv1.AccessDirect, apiv1.AccessGateway:
	default:
		errs = append(errs, fmt.Errorf("access must be %s or %s", apiv1.AccessDirect, apiv1.AccessGateway))
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return &t, nil
}

// ErrClusterMismatch is the token-theft guard's refusal: client-go would
// send the credential to a cluster (server or CA) other than the one the
// broker's kubeconfigs name. It is not retryable: whoever wrote the
// ClusterProfile (or the kubeconfig) must correct it.
var ErrClusterMismatch = errors.New("refused: the credential would go to a cluster the broker does not name")

// ClusterRef is the cluster a broker's kubeconfigs name: where its
// credentials may be sent.
type ClusterRef struct {
	Server string `json:"server"`
	CAData []byte `json:"caData,omitempty"`
}

// CheckCluster is the token-theft guard. client-go sends the credential
// to got.Server, verified with got.CAData, and whoever can write a
// ClusterProfile (or a kubeconfig) chooses both; so the plugin hands out a
// credential only when they are the server and CA of want, the cluster of
// the broker's kubeconfig. Servers are compared as URLs (scheme, host
// case-insensitively, port with https' default, path without a trailing
// slash); CAs as sets of certificates, so that PEM formatting and order do
// not matter. A CA that is absent on either side, or that holds no
// certificate, never matches: the system roots would let any public
// certificate through. The error wraps ErrClusterMismatch and names both
// servers (no secret is in either).
func CheckCluster(got Cluster, want ClusterRef) error {
	gs, err1 := canonicalServer(got.Server)
	ws, err2 := canonicalServer(want.Server)
	if err1 != nil || err2 != nil || gs != ws {
		return fmt.Errorf("%w: spec.cluster.server is %q, the broker's cluster is %q", ErrClusterMismatch, short(got.Server), short(want.Server))
	}
	gc, ok1 := certSet(got.CAData)
	wc, ok2 := certSet(want.CAData)
	if !ok1 || !ok2 || !slices.Equal(gc, wc) {
		return fmt.Errorf("%w: the CA of spec.cluster (certificate-authority-data) is not the broker's cluster's CA for %q", ErrClusterMismatch, short(want.Server))
	}
	return nil
}

// canonicalServer is an API server URL in one spelling per server.
func canonicalServer(s string) (string, error) {
	u, err := url.Parse(s)
	if err != nil || u.Scheme != "https" || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return "", errors.New("not an https URL")
	}
	host, port := u.Hostname(), u.Port()
	if port == "" {
		port = "443"
	}
	return "https://" + net.JoinHostPort(strings.ToLower(host), port) + strings.TrimRight(u.EscapedPath(), "/"), nil
}

// certSet is the sorted DER of every certificate in a PEM bundle; false
// when there is none or one does not parse.
func certSet(pemData []byte) ([]string, bool) {
	var out []string
	rest := pemData
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		if _, err := x509.ParseCertificate(b.Bytes); err != nil {
			return nil, false
		}
		out = append(out, string(b.Bytes))
	}
	if len(out) == 0 {
		return nil, false
	}
	slices.Sort(out)
	return slices.Compact(out), true
}
