// Package config is the agent's configuration file (agent.yaml): its
// types, Load and Parse (strict YAML), the defaults (Default), every
// problem with its field path (Validate), the schema check behind
// `tokenbroker config validate` (CheckDocument, Notes), and the names the
// agent writes on its outputs (labels, annotations, data keys, the .meta
// file), which a configuration may not set. It calls nothing: the agent
// package runs what it describes.
package config
